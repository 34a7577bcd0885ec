# Two commands for a fresh machine (README): `make train` and `make test`. Both install into .venv once
# (re-running reuses it; a changed pyproject.toml reinstalls) and build DeepSpeed's CPU ops once.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?= -q

.PHONY: install train test test-unit test-gpu clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	@PY=$(PY) scripts/check_prereqs.sh
	@[ -x $(BIN)/python ] || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	DS_ACCELERATOR=cpu $(BIN)/python scripts/build_ds_ops.py
	@touch $(STAMP)

train: install
	$(BIN)/python jobs/train.py $(ARGS)

test: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

# The tests that start no Ray and no process (config, cleaning, prompts, packing, ...): about a minute.
test-unit: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS) tests/unit

# The GPU suite (tests/gpu): one CUDA GPU, under 10 minutes; without CUDA every test skips. On a GPU image
# that already holds the project's packages: make test-gpu GPU_PY=python3 (no venv).
GPU_PY ?=
test-gpu: $(if $(GPU_PY),,install)
	PYTORCH_CUDA_ALLOC_CONF=$${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
	    PATH="$(abspath $(BIN)):$$PATH" $(or $(GPU_PY),$(BIN)/python) -m pytest $(PYTEST_ARGS) tests/gpu

clean-venv:
	rm -rf $(VENV)
