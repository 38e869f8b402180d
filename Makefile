# One virtualenv (.venv) with attnkern installed editable (edits to C, Cython or
# Python are rebuilt on the next import), the test tools and asv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ASV := $(VENV)/bin/asv
.PHONY: setup system-packages test test-fast bench site compare clean

setup: system-packages $(VENV)/.installed

# Debian packages the tests use: headless Chromium (the asv site test; a Chrome
# already installed, as on GitHub's runners, does too) and shellcheck (actionlint
# checks the workflows' scripts with it).
system-packages:
	@missing=""; \
	found() { command -v "$$1" > /dev/null; }; \
	found chromium || found chromium-browser || found google-chrome || missing="$$missing chromium"; \
	found shellcheck || missing="$$missing shellcheck"; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
		$$sudo apt-get update -q && $$sudo apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(VENV)/.installed: pyproject.toml requirements-build.txt requirements-bench.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements-build.txt -r requirements-bench.txt
	$(PY) -m pip install --no-build-isolation -e '.[test,bench]'
	# the JavaScript libraries asv's site loads from CDNs, for offline use (tools/offline_site.py)
	$(PY) tools/offline_site.py --download
	touch $@

# Set up from a fresh clone and run the tests, the slow asv end-to-end ones included.
test: setup
	$(PY) -m pytest

# The tests without the slow asv end-to-end ones (seconds, not minutes).
test-fast: setup
	$(PY) -m pytest -m "not slow"

# Set up from a fresh clone and run the main job: the asv suite on HEAD (its wheel
# built in asv's own virtualenv), then the site with its history.
bench: setup
	$(ASV) machine --yes
	$(ASV) run --show-stderr HEAD^!
	$(MAKE) site

# Publish the site from all stored results, loading its JavaScript from local copies.
site: setup
	$(ASV) publish
	$(PY) tools/offline_site.py .asv/html
	@echo
	@echo "Site published to .asv/html. To view it: $(ASV) preview   (then open the address it prints)"

# The side-by-side table of native.flash, torch.sdpa, numpy.naive and the sgemm ceiling.
compare: setup
	mkdir -p bench-results
	$(PY) -m attnkern.bench --memory --json bench-results/latest.json

clean:
	rm -rf $(VENV) build bench-results .asv
