# DMuon + Phase D. `make verify-traffic` runs the main job, `make test` the test suite.
# The first target that needs Python creates .venv and installs everything into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build that lies on the project's machines; on a GPU node PyPI's build of the same
# release is the CUDA one. Override with `make TORCH_VERSION=...`.
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

.PHONY: install test test-all verify-traffic nsys-verify gpu-check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-all: $(STAMP)
	$(PY) -m pytest -m ''

verify-traffic: $(STAMP)
	$(PY) -m verify.launch $(ARGS)

nsys-verify: $(STAMP)
	$(PY) -m verify.nsys_verify $(ARGS)

# One CUDA GPU: every DMuon mode at W=1 on NCCL through the NCCL-log path + CUDA parity.
# Exit 0 pass, 1 fail, 3 no usable GPU here (skipped; it prints what is missing).
gpu-check: $(STAMP)
	$(PY) -m verify.gpu_check $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) traces/*/ .pytest_cache
