# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel pinned here only; in an NVIDIA container create the venv with
# VENV_FLAGS=--system-site-packages and TORCH_SPEC= to keep the container's CUDA torch.
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install sysdeps sglang-wheels test lint run bench clean slurm-up slurm-down

install: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install --quiet "$(TORCH_SPEC)")
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# What the suite needs from the system (root, or sudo): a real Slurm cluster on this
# machine (2 virtual nodes, accounting) and shellcheck for the sbatch scripts.
sysdeps: slurm-up
	command -v shellcheck >/dev/null || apt-get install -y -qq shellcheck >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null; }

# SGLang's own code for the contract tests (tests/_sglang.py loads it from the wheels; it
# is never installed or imported as a package). Downloaded once per machine.
SGLANG_WHEELS ?= $(HOME)/.cache/areal-mcore/sglang
SGLANG_VERSIONS := 0.5.23 0.5.20
sglang-wheels: install
	@mkdir -p $(SGLANG_WHEELS)
	@for v in $(SGLANG_VERSIONS); do \
	  ls $(SGLANG_WHEELS)/sglang-$$v-*.whl >/dev/null 2>&1 || \
	  $(PY) -m pip download --quiet --no-deps --dest $(SGLANG_WHEELS) sglang==$$v || exit 1; \
	done

slurm-up:
	bash scripts/slurm_local_up.sh

slurm-down:
	bash scripts/slurm_local_down.sh

# AREAL_REQUIRE_SYSDEPS: Slurm/shellcheck tests fail instead of skipping when missing.
test: install sysdeps sglang-wheels
	AREAL_REQUIRE_SYSDEPS=1 SGLANG_WHEELS=$(SGLANG_WHEELS) $(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	shellcheck -x scripts/*.sh launch/slurm/*.sh

bench: install
	$(PY) bench/allocator.py
	$(PY) bench/rollout_server.py
	$(PY) bench/kernels.py

run: install
	PY=$(PY) scripts/quickstart.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
