# Two set-up-and-go commands: `make demo` (the main job) and `make test` (lint, types, all tests).
# Each creates or refreshes ./.venv. TORCH_SPEC defaults to the CPU build that installs quickly here;
# GPU users can pass their own, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.criticalkv-installed

.PHONY: install test lint demo clean

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

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache .hypothesis
