# Two set-up-and-go commands: `make demo` (the main job) and `make test` (lint, types, all tests).
# Each creates or refreshes ./.venv. TORCH_SPEC defaults to the CPU build that installs quickly here;
# GPU users can pass their own, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.criticalkv-installed

.PHONY: install test lint demo clean reproduce

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/criticalkv demo --out demo-out

# `make reproduce`: every sweep behind docs/results/claims.md (each resumable: an interrupted run
# continues where it stopped), then the generator. Run times per step: docs/results/claims.md.
CKV := $(VENV)/bin/criticalkv
RULER_TASKS ?= all
RULER_SAMPLES ?= 20
reproduce: $(STAMP)
	$(CKV) eval --benchmark ruler --tasks $(RULER_TASKS) --lengths 1024 \
	    --methods full,snapkv,critical-snapkv,adakv,critical-adakv,defensivekv,layer-defensivekv \
	    --budgets 0.1,0.2,0.4 --samples $(RULER_SAMPLES) --mode question-aware --max-new-tokens 32 \
	    --model default --out docs/results/ruler-default/aware-20
	$(CKV) perturbation --model default --methods snapkv,adakv --budgets 0.1,0.2,0.4 --samples 12 \
	    --length 2048 --window 32 --out docs/results/perturbation-default/run
	$(PY) benchmarks/performance.py --out docs/results/performance
	$(PY) benchmarks/ablations.py --out docs/results/ablations/fidelity --samples 5 --fidelity-only \
	    --doc docs/results/ablations.md
	$(PY) benchmarks/claims.py --ruler docs/results/ruler-default/aware-20 \
	    --perturbation docs/results/perturbation-default/run --performance docs/results/performance \
	    --out docs/results/claims.md

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache .hypothesis
