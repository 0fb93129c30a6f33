# maskd — make setup | run | test | proto
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup run test lint proto clean

setup: $(STAMP)

# torch 2.13.0 first: the CPU build on this machine's disk, so nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/maskd demo

test: setup lint
	$(PY) -m pytest -q -ra

# ruff and mypy over the runtime packages, and the import contracts (pyproject.toml)
lint: setup
	$(VENV)/bin/ruff check maskd client cluster
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --config pyproject.toml --no-cache

proto: setup
	$(PY) -m maskd.tools.protogen

clean:
	rm -rf $(VENV) build *.egg-info
