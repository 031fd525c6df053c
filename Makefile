# Two commands: `make serve` (the server on the default tiny checkpoint) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test unit integration bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch unless the venv already has one (GPU users install their CUDA build first);
	# a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

serve: install
	$(PY) -m serving.serve $(ARGS)

test: install
	$(PY) -m pytest -q tests

unit: install
	$(PY) -m pytest -q tests/unit

integration: install
	$(PY) -m pytest -q tests/integration

# streaming latency and throughput against concurrency; e.g. make bench ARGS="--preset small --max-patches 24"
bench: install
	$(PY) -m bench $(ARGS)

clean:
	rm -rf cache build results .pytest_cache
