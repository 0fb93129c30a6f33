# maskd — make setup | run | test | proto | image
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup run test lint proto image clean

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

# The container image (Dockerfile) with the first OCI builder that can run here. IMAGE_TARGET:
# cluster (server + Ray, the chart's default image) or server (no Ray, tagged <version>-server).
IMAGE ?= ghcr.io/maskd/maskd
IMAGE_TARGET ?= cluster
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_TAG ?= $(VERSION)$(if $(filter server,$(IMAGE_TARGET)),-server,)
OCI_BUILDERS ?= docker podman buildah
# e.g. BUILD_ARGS="--build-arg PYTHON_IMAGE=registry.local/python:3.11-slim-bookworm"
BUILD_ARGS ?=

image:
	@set -e; builder=""; why=""; \
	for b in $(OCI_BUILDERS); do \
	  if ! command -v "$$b" >/dev/null 2>&1; then why="$$why\n  $$b: not installed"; continue; fi; \
	  if out=$$("$$b" info 2>&1 >/dev/null); then builder="$$b"; break; fi; \
	  why="$$why\n  $$b: installed, but \`$$b info\` fails: $$(printf '%s' "$$out" | grep -v '^$$' | tail -n 1)"; \
	done; \
	if [ -z "$$builder" ]; then \
	  printf 'make image: no OCI builder can run on this machine:%b\n%s\n' "$$why" \
	    "Install and start one (docker with its engine, podman or buildah), then run make image again." >&2; \
	  exit 2; \
	fi; \
	case "$$builder" in docker) build="docker build";; *) build="$$builder build --format docker";; esac; \
	echo "make image: $$build --target $(IMAGE_TARGET) -t $(IMAGE):$(IMAGE_TAG) $(BUILD_ARGS) ."; \
	$$build --target $(IMAGE_TARGET) -t $(IMAGE):$(IMAGE_TAG) $(BUILD_ARGS) .

clean:
	rm -rf $(VENV) build *.egg-info
