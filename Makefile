# Two commands: `make serve` (the server on the default tiny checkpoint) and `make test`.
# Each step prints one line; pip runs quietly (-q) and says something only when it fails.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
# setuptools prints a notice on every editable install ("Editable installation..."): not ours to act on
PIP_QUIET := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q
TORCH := torch==2.13.0
# The tests run in TEST_WORKERS processes (pytest-xdist), each test module whole in one of them (its servers
# are shared by its tests): 2 by default, the CI machine's cores. Most of a test's time is spent waiting for a
# server, so two took a third off the wall time here. TEST_WORKERS=0 runs them in pytest's own process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: install serve test lint test-browser browser-deps unit integration static bench bench-gpu clean

install: $(TEST_STAMP)

# torch==2.13.0 only if the venv has no torch (README "Which torch make installs"): from PyPI that is the
# CUDA 13 build; where pip's find-links offer torch-2.13.0+cpu (the CI machines), pip takes that. GPU users
# install their CUDA build into .venv first; so may laptop users the CPU build.
# Then the serving packages only: the server, the gateway and the client (pyproject's [serve] extra).
$(SERVE_STAMP): pyproject.toml Makefile
	@test -x $(PY) || { echo "[make] creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV) && \
	  $(PY) -m pip install -q --upgrade pip; }
	@$(PY) -c "import torch" 2>/dev/null || { \
	  echo "[make] installing $(TORCH), as $(VENV) has none: from PyPI on Linux x86_64 that is the CUDA 13 build" \
	       "(a 527 MB wheel plus NVIDIA's CUDA libraries, GBs); Ctrl-C now for the CPU build: README," \
	       "Which torch make installs"; \
	  $(PY) -m pip install -q $(TORCH); }
	@echo "[make] installing the serving packages into $(VENV) (pyproject [serve]; a minute or two the first time)"
	@$(PIP_QUIET) -e ".[serve]"
	@touch $@

# the tests need the serving packages and the [test] extra (pytest, locust, selenium, the linters, ...)
$(TEST_STAMP): $(SERVE_STAMP)
	@echo "[make] installing the test packages into $(VENV) (pyproject [test])"
	@$(PIP_QUIET) -e ".[serve,test]"
	@touch $@

serve: $(SERVE_STAMP)
	@echo "[make] starting the server: python -m serving.serve $(ARGS)"
	@$(PY) -m serving.serve $(ARGS)

# The browser tests of the web page need Debian's chromium and chromium-driver: `make test` installs
# them where it can (root with apt-get) and otherwise runs everything else and says they were skipped.
test: $(TEST_STAMP)
	-@$(MAKE) -s browser-deps 2>/dev/null
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  echo "NOTE: no chromium/chromedriver here: the browser tests are skipped (make test-browser installs them)"
	$(PY) -m ruff check --quiet .
	$(PY) -m ruff format --check --quiet .
	$(PYTEST) --durations=15 tests

# ruff's rules (pyproject [tool.ruff.lint]) and its layout (ruff format; `ruff format .` applies it) on the
# whole tree; `make test` runs both first
lint: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test-browser: $(TEST_STAMP) browser-deps
	$(PY) -m pytest -q -m browser tests/integration/test_page.py

browser-deps:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "install chromium and chromium-driver (Debian: sudo apt-get install chromium chromium-driver)"; exit 1; fi; \
	  echo "installing chromium and chromium-driver with apt-get"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }; \
	fi

unit: $(TEST_STAMP)
	$(PYTEST) tests/unit

integration: $(TEST_STAMP)
	$(PYTEST) tests/integration

# hadolint on the Dockerfile, Kubernetes manifests against the schemas, the Grafana dashboard's structure
static: $(TEST_STAMP)
	$(PYTEST) tests/static

# streaming latency and throughput against concurrency; e.g. make bench ARGS="--preset small --max-patches 24"
bench: $(TEST_STAMP)
	$(PY) -m bench $(ARGS)

# on a CUDA machine: the full model with random weights, step times at 1..256 streams, one table
bench-gpu: $(TEST_STAMP)
	bench/gpu.sh $(ARGS)

clean:
	rm -rf cache build results .pytest_cache
