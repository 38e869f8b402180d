# One virtualenv (.venv) with attnkern installed editable: edits to C, Cython
# or Python are rebuilt on the next import.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-build.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements-build.txt
	$(PY) -m pip install --no-build-isolation -e '.[test,bench]'
	touch $@

# Set up from a fresh clone and run the tests.
test: setup
	$(PY) -m pytest

# Set up from a fresh clone and run the main job: the side-by-side benchmark.
bench: setup
	mkdir -p bench-results
	$(PY) -m attnkern.bench --memory --json bench-results/latest.json

clean:
	rm -rf $(VENV) build bench-results
