# Two set-up-and-go commands: `make demo` (the main job) and `make test` (lint, types, all tests).
# Each creates or refreshes ./.venv. TORCH_SPEC defaults to the CPU build that installs quickly here;
# GPU users can pass their own, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.criticalkv-installed

.PHONY: install test lint demo clean test-kvpress

# kvpress 0.5.5 pins transformers < 5.3, so its tests run in a second venv (the [bench] extra + pytest)
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_STAMP := $(KVPRESS_VENV)/.criticalkv-installed
KVPRESS_TESTS ?= tests/test_kvpress_agreement.py tests/test_kvpress_decode.py tests/test_bench.py

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

$(KVPRESS_STAMP): pyproject.toml
	test -x $(KVPRESS_PY) || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install --quiet --upgrade pip
	$(KVPRESS_PY) -c "import torch" 2>/dev/null || $(KVPRESS_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(KVPRESS_PY) -m pip install --quiet -e ".[bench]" "pytest>=8"
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

demo: $(STAMP)
	$(VENV)/bin/criticalkv demo --out demo-out

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) demo-out .pytest_cache .mypy_cache .ruff_cache .hypothesis
