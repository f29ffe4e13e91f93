# DMuon + Phase D. `make verify-traffic` runs the main job, `make test` the test suite.
# The first target that needs Python creates .venv and installs everything into it.
# On a GPU node (its own torch, often no network): `make gpu-node PYTHON=/path/to/python`
# once makes .venv over that Python's packages (tools/node_env.py: installs nothing already
# there); every target then uses it, until `make clean`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build that lies on the project's machines; on a GPU node PyPI's build of the same
# release is the CUDA one. Override with `make TORCH_VERSION=...`.
TORCH_VERSION ?= 2.13.0
# What `make install` and `make gpu-node` install besides the core: everything the suite uses.
EXTRAS ?= test,gpu,plots
# A venv made by `make gpu-node` carries this mark (line 1: the Python it lies over).
SYSTEM_MARK := $(VENV)/.system-torch
BASE_PY := $(shell head -n1 $(SYSTEM_MARK) 2>/dev/null)
ifneq ($(BASE_PY),)
PYTHON ?= $(BASE_PY)
STAMP := $(SYSTEM_MARK)
else
PYTHON ?= python3
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
endif
# `make test-torch TORCH_PY=/path/to/python`: the suite against the torch that Python has.
TORCH_VENV ?= .venv-torch
# pytest-xdist workers for the test targets, one test file per worker at a time (module
# fixtures stay shared): the serial suite leaves about a third of a 2-core machine idle while
# ranks wait on each other. TEST_WORKERS=0 runs it in one process (no pytest-xdist needed).
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: install gpu-node test-torch test test-all test-torchtitan verify-traffic verify-traffic-full nsys-verify gpu-check bench timeline-png clean

# pyproject's pinned `torchtitan` extra, installed without torchtitan's own requirements
# (10 s here): the suite trains torchtitan's llama3 with DMuon (tests/distributed/parity/
# test_torchtitan.py, skipped where it is missing, e.g. an offline GPU node).
TORCHTITAN_PKGS = $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['torchtitan']))")

$(VENV)/.installed-$(TORCH_VERSION): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(PY) -m pip install --quiet --no-deps $(TORCHTITAN_PKGS)
	touch $@

# pyproject.toml changed since `make gpu-node`: redo it over the same Python.
$(SYSTEM_MARK): pyproject.toml
	$(PYTHON) tools/node_env.py --venv $(VENV) --extras '$(EXTRAS)'

gpu-node:
	$(PYTHON) tools/node_env.py --venv $(VENV) --extras '$(EXTRAS)'

test-torch:
	@test -n "$(TORCH_PY)" || { echo "make test-torch: must name the Python, e.g. TORCH_PY=/path/to/venv/bin/python" >&2; exit 2; }
	$(TORCH_PY) tools/node_env.py --venv $(TORCH_VENV) --extras '$(EXTRAS)'
	$(TORCH_VENV)/bin/python -m pytest $(XDIST) $(PYTEST_ARGS)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(XDIST)

test-all: $(STAMP)
	$(PY) -m pytest $(XDIST) -m ''

# DMuon as torchtitan's optimizer, on torchtitan itself: every case, the slow ones too (about
# 2 minutes at W = 4 on gloo); installs the pinned extra where `make gpu-node` made the venv.
test-torchtitan: $(STAMP)
	$(PY) -m pip install --quiet --no-deps $(TORCHTITAN_PKGS)
	$(PY) -m pytest -m '' tests/distributed/parity/test_torchtitan.py tests/distributed/parity/test_torchtitan_pp.py tests/dmuon/test_torchtitan_dims.py tests/distributed/api/test_torchtitan_stage_mesh.py

# verify-traffic, nsys-verify and gpu-check write their exit code to <out>/exit_code and print
# it; make itself exits 0 or 2, so CI runs `bin/dmuon-ci <target> ARGS...`, which returns the
# code (0 pass, 1 a check failed, 2 bad input, 3 missing hardware; docs/verify.md).
verify-traffic: $(STAMP)
	$(PY) -m verify.run.launch $(ARGS)

# The default run, then one run per path it leaves out (TP, EP, PP, CP, bf16, the replicated rest, one
# unit per block), each compared with its committed baseline (verify/baselines/); exits with
# the worst run's code (docs/verify.md, "The full profile").
FULL_RUNS := default|--nproc 4 --tp 2|--nproc 4 --ep 2|--nproc 4 --tp 2 --ep 2|--nproc 4 --pp 2|--nproc 4 --cp 2|--mixed-precision bf16|--rest replicate|--coalesce block
FULL_OUT ?= traces/full-$(shell date -u +%Y%m%dT%H%M%S)
verify-traffic-full: $(STAMP)
	@worst=0; runs='$(FULL_RUNS)'; IFS='|'; for run in $$runs; do \
	  name=$$(echo "$$run" | tr -d ' -'); args=$$([ "$$run" = default ] || echo "$$run"); \
	  echo "== verify-traffic $$args -> $(FULL_OUT)/$$name"; \
	  IFS=' '; $(PY) -m verify.run.launch --out-dir $(FULL_OUT)/$$name $$args $(ARGS); code=$$?; IFS='|'; \
	  [ $$code -gt $$worst ] && worst=$$code; \
	done; echo "verify-traffic-full: worst exit code $$worst, in $(FULL_OUT)/"; exit $$worst

nsys-verify: $(STAMP)
	$(PY) -m verify.sources.nsys_verify $(ARGS)

# One CUDA GPU, offline, < 5 min: every DMuon mode at W=1 on NCCL, all four trace sources,
# CUDA-vs-CPU parity, no host sync in a step, stream order with a negative control, peak
# memory; one report file, traces/gpu-check-<time>/gpu-check.json. Exit 0, 1, 3 no usable GPU.
gpu-check: $(STAMP)
	$(PY) -m verify.run.gpu_check $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# docs/performance.md "Timeline of one step": one measured step of dmuon-z3 on TinyGPT, W=4 gloo, drawn per rank
# (compute, and each collective from issue to wait return) into docs/timeline-dmuon-z3.png.
TIMELINE_OUT ?= traces/timeline-dmuon-z3
timeline-png: $(STAMP)
	$(PY) -m verify.run.launch --nproc 4 --backend gloo --out-dir $(TIMELINE_OUT) --modes dmuon-z3 --steps-measured 1 $(ARGS)
	cp $(TIMELINE_OUT)/dmuon-z3/timeline.png docs/timeline-dmuon-z3.png

clean:
	rm -rf $(VENV) $(TORCH_VENV) traces/*/ .pytest_cache
