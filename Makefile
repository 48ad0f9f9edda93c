PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install test test-fast

# torch is pinned first so that pip takes the CPU build instead of a multi-GB CUDA build.
install:
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"

test: install
	$(PYTHON) -m pytest -q tests

test-fast:
	$(PYTHON) -m pytest -q -x tests
