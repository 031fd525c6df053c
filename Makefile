# Two commands: `make serve` (the server on the default tiny checkpoint) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-browser browser-deps unit integration static bench bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 only if the venv has no torch (README "Which torch make installs"): from PyPI that is
	# the CUDA 13 build; where pip's find-links offer torch-2.13.0+cpu (the CI machines), pip takes that.
	# GPU users install their CUDA build into .venv first; so may laptop users the CPU build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# setuptools prints a notice on every editable install ("Editable installation..."): not ours to act on
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

serve: install
	$(PY) -m serving.serve $(ARGS)

# The browser tests of the web page need Debian's chromium and chromium-driver: `make test` installs
# them where it can (root with apt-get) and otherwise runs everything else and says they were skipped.
test: install
	-@$(MAKE) -s browser-deps 2>/dev/null
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  echo "NOTE: no chromium/chromedriver here: the browser tests are skipped (make test-browser installs them)"
	$(PY) -m pytest -q tests

test-browser: install browser-deps
	$(PY) -m pytest -q -m browser tests/integration/test_page.py

browser-deps:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "install chromium and chromium-driver (Debian: sudo apt-get install chromium chromium-driver)"; exit 1; fi; \
	  echo "installing chromium and chromium-driver with apt-get"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }; \
	fi

unit: install
	$(PY) -m pytest -q tests/unit

integration: install
	$(PY) -m pytest -q tests/integration

# hadolint on the Dockerfile, Kubernetes manifests against the schemas, the Grafana dashboard's structure
static: install
	$(PY) -m pytest -q tests/static

# streaming latency and throughput against concurrency; e.g. make bench ARGS="--preset small --max-patches 24"
bench: install
	$(PY) -m bench $(ARGS)

# on a CUDA machine: the full model with random weights, step times at 1..256 streams, one table
bench-gpu: install
	bench/gpu.sh $(ARGS)

clean:
	rm -rf cache build results .pytest_cache
