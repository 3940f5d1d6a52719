# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install, train four strategies and one process at the study's size
#               and at 1M parameters, print the verdict and write the HTML report
#   make test   create .venv, install, run the tests a developer runs before every commit (all
#               but the slow tier and tests/cluster: a few minutes on 2 cores)
#   make test-slow   the slow tier (tests marked slow: whole sweeps, every strategy of a study,
#               kills and resumes, launchers started as users start them)
#   make test-cluster   tests against real SLURM (munge, slurmctld, 2 slurmd) and sshd + pdsh
#               daemons they start on 127.0.0.1, and the report in headless Chromium; installs
#               the Debian packages when root, else skips
#   make check  lint (ruff check), format check (ruff format --check): make lint; types (mypy): make types
#   .ci/run runs all four.
#
# TORCH_SPEC picks the torch build. The default is the CPU wheel that lies on this project's
# machines; on a GPU machine install your own CUDA build, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# install builds the fused B-spline op ahead of time (kanscale build-ops: about a minute on 2
# cores, its start, end and folder shown), so that no run compiles it; where it cannot be built,
# model.impl auto runs the PyTorch layer instead.
# C++ extensions a process compiles are kept in the virtual environment (kanscale/extensions.py),
# exported so that every process a target starts finds them there, with the environment's own
# ninja first on PATH: two ninjas hash a build differently and rebuild each other's.
TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
export TORCH_EXTENSIONS_DIR
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: test-both demo test test-slow test-cluster check lint types install clean

install: $(STAMP)

# Setting up takes minutes on a fresh machine: each stage says what it does before it starts.
$(STAMP): pyproject.toml
	@echo "[setup 1/5] the virtual environment $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "[setup 2/5] pip itself, upgraded"
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "[setup 3/5] $(TORCH_SPEC) (the CPU wheel is about 190 MB to download; already installed: seconds)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	@echo "[setup 4/5] kanscale with every extra and the developer tools (DeepSpeed, Accelerate, pykan, ...)"
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	@echo "[setup 5/5] the fused B-spline op, built ahead of time (about a minute on 2 cores)"
	$(BIN)/kanscale build-ops --if-possible
	touch $(STAMP)
	@echo "[setup] done: $(VENV) is ready"

demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/kanscale sweep configs/studies/demo_cpu.yaml --out runs/demo
	$(BIN)/kanscale analyze runs/demo

# Both tiers run on every core, two at most (each distributed test already starts two ranks); a
# file's tests stay on one worker, so its module fixtures are built once (a session fixture, once
# per worker that needs it: grouping the files that share one measured slower, 6:01 against 4:48).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 2 ] && n=2; echo $$n)
PYTEST := $(BIN)/python -m pytest -q --durations=40 -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST) -m "not slow" tests --ignore=tests/cluster

check: lint types

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy

test-slow: $(STAMP)
	$(PYTEST) -m slow tests --ignore=tests/cluster

# Both tiers in one session, as .ci/run runs them: neither waits for the other's last file
test-both: $(STAMP)
	$(PYTEST) tests --ignore=tests/cluster

test-cluster: $(STAMP)
	bash scripts/cluster_packages.sh
	KANSCALE_CLUSTER_TESTS=1 $(BIN)/python -m pytest -q tests/cluster

clean:
	rm -rf $(VENV) runs .pytest_cache
