# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel pinned here only; in an NVIDIA container create the venv with
# VENV_FLAGS=--system-site-packages and TORCH_SPEC= to keep the container's CUDA torch.
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test lint run bench clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install --quiet "$(TORCH_SPEC)")
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/allocator.py
	$(PY) bench/rollout_server.py

run: install
	PY=$(PY) scripts/quickstart.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
