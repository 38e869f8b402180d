# One virtualenv (.venv) with attnkern installed editable (edits to C, Cython or
# Python are rebuilt on the next import), the test tools and asv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ASV := $(VENV)/bin/asv
.PHONY: setup system-packages test test-fast bench history gpu-history site compare features gate calibrate-gate sanitize test-sanitize fuzz clean

setup: system-packages $(VENV)/.installed

# Debian packages the tests use: headless Chromium (the asv site test; a Chrome
# already installed, as on GitHub's runners, does too), shellcheck (actionlint
# checks the workflows' scripts with it), Valgrind (the counted benchmarks and
# the regression gate count instructions under callgrind), poppler-utils
# (pdftoppm: the report's pages rendered to images) and ccache (meson compiles through it
# where it is found: the tests build the wheels of commits that differ in one C file, for
# the asv history and the gate, 30 s a build cold and 5 s from the cache).
system-packages:
	@missing=""; \
	found() { command -v "$$1" > /dev/null; }; \
	found chromium || found chromium-browser || found google-chrome || missing="$$missing chromium"; \
	found shellcheck || missing="$$missing shellcheck"; \
	found valgrind || missing="$$missing valgrind"; \
	found pdftoppm || missing="$$missing poppler-utils"; \
	found ccache || missing="$$missing ccache"; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
		$$sudo apt-get update -q && $$sudo apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(VENV)/.installed: pyproject.toml requirements-build.txt requirements-bench.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements-build.txt -r requirements-bench.txt
	# the extras' ranges and the team's pins (requirements-test.txt) resolved together; the
	# build directory one level down, as meson-python's wheel builds have theirs (.mesonpy-*),
	# so that ccache sees the same compile lines: the wheels the tests and asv build of this
	# commit then come from the cache (5 s, not 30)
	$(PY) -m pip install --no-build-isolation -Cbuild-dir=build-editable -e '.[test,bench]' -r requirements-test.txt
	# the JavaScript libraries asv's site loads from CDNs, for offline use (tools/offline_site.py)
	$(PY) tools/offline_site.py --download
	touch $@

# Set up from a fresh clone and run the tests, the slow asv end-to-end ones included: the
# others on two pytest-xdist workers (a file's tests on one worker; most are single-threaded
# Python, Numba's CUDA simulator above all), and beside them, in one process of their own, the
# slow tests that compare no times (the suite's smoke run, history over a broken commit: the
# xdist stage leaves about a quarter of the cores idle), their output after the stage's. Then
# the tests marked alone, one at a time with nothing beside them: they compare kernels' times
# across tools (a busy machine would fail them). Only one process at a time writes asv's
# ~/.asv-machine.json. The 15 minutes this command may take on a 2-core machine: 14m17s measured.
test: setup
	@$(PY) -m pytest -m "slow and not alone" --durations=5 > .slow-beside.log 2>&1 & beside=$$!; \
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile; stage=$$?; \
	wait $$beside; slow=$$?; cat .slow-beside.log; \
	test $$stage -eq 0 -a $$slow -eq 0
	$(PY) -m pytest -m alone --durations=11

# The tests without the slow asv end-to-end ones (seconds, not minutes).
test-fast: setup
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile

# Set up from a fresh clone and run the main job: the asv suite on HEAD (its wheel
# built in asv's own virtualenv), then the site with its history, and the report
# (attnkern report --quick: bench, roofline, study and tune in short runs) beside it.
bench: setup
	$(ASV) machine --yes
	$(ASV) run --show-stderr HEAD^!
	$(MAKE) site
	$(PY) -m attnkern report --quick --out .asv/html/report
	@echo "Report: .asv/html/report/report.html (and .pdf), served with the site by $(ASV) preview"

# History for the site: the counted benchmarks and a few timings over the last N
# commits of main (tools/history.py --help says what and how), then the site.
# Commits with results are skipped; one that fails to build is named, not fatal.
N ?= 10
HISTORY_ARGS ?=
history: setup
	$(PY) tools/history.py --commits $(N) $(HISTORY_ARGS)
	$(MAKE) site

# GPU history (tools/gpu_history.py): a folder for the device machine that runs the suite's GPU
# classes on COMMIT; then, with the folder's results/ brought back, RESULTS=<it>/results merges
# them into .asv/results and publishes the site with the GPU machine beside this one.
COMMIT ?= HEAD
GPU_HISTORY_ARGS ?=
gpu-history: setup
	$(if $(RESULTS),$(PY) tools/gpu_history.py merge $(RESULTS) && $(MAKE) site,\
		$(PY) tools/gpu_history.py prepare $(COMMIT) --out .gpu-history $(GPU_HISTORY_ARGS))

# Publish the site from all stored results, loading its JavaScript from local copies.
site: setup
	$(ASV) publish
	$(PY) tools/offline_site.py .asv/html
	@echo
	@echo "Site published to .asv/html. To view it: $(ASV) preview   (then open the address it prints)"

# The side-by-side table (attnkern bench): native.flash, torch.sdpa and numpy.naive checked
# against the float64 reference, then timed, with the float32 matmul ceiling.
compare: setup
	mkdir -p bench-results
	$(PY) -m attnkern bench --memory --json bench-results/latest.json --csv bench-results/latest.csv

# The attention features against torch doing the same work (attnkern features), then
# the window study: W = 1024 at N = 2048..16384 against full causal (docs/feature-bench.md).
features: setup
	mkdir -p bench-results
	$(PY) -m attnkern features --n 4096 --json bench-results/features.json --csv bench-results/features.csv
	$(PY) -m attnkern features --window-study --json bench-results/window-study.json \
		--csv bench-results/window-study.csv

# The regression gate: HEAD against BASE, counted instructions (Valgrind's AVX2 path and,
# where the CPU has AVX-512, native.flash's AVX-512 code: tools/avx512_count.py) and
# paired timing (docs/regression-gate.md). Exits non-zero if a kernel got slower.
# DEVICE=cuda gates the GPU kernels instead; it runs with GPU_PYTHON (a Python
# whose torch has CUDA, with numba-cuda, Triton and the build requirements), not
# .venv, whose torch is the CPU build.
BASE ?= main
GATE_ARGS ?=
DEVICE ?= cpu
GPU_PYTHON ?= python3
gate: $(if $(filter cuda,$(DEVICE)),,setup)
	$(if $(filter cuda,$(DEVICE)),$(GPU_PYTHON),$(PY)) tools/gate.py --base $(BASE) --device $(DEVICE) $(GATE_ARGS)

# Re-measure the gate's false alarms and detection rates (about an hour).
calibrate-gate: setup
	$(PY) tools/calibrate_gate.py

# The native extension built with AddressSanitizer + UndefinedBehaviorSanitizer
# (meson's b_sanitize) into its own virtualenv, .sanitize/venv, which takes every
# other package from .venv (docs/hardening.md).
SAN := .sanitize
SAN_PY := $(SAN)/venv/bin/python
sanitize: setup
	rm -rf $(SAN)/wheel $(SAN)/build
	$(PY) -m pip wheel --no-deps --no-build-isolation -q -w $(SAN)/wheel -Cbuild-dir=$(SAN)/build \
		-Csetup-args=-Db_sanitize=address,undefined -Csetup-args=-Db_lundef=false \
		-Csetup-args=-Dbuildtype=debugoptimized .
	$(PYTHON) -m venv --clear --without-pip $(SAN)/venv
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> $$($(SAN_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/attnkern-deps.pth
	$(PY) -m pip --python $(SAN_PY) install -q --no-deps $(SAN)/wheel/*.whl

# The tests of the library (not the slow end-to-end ones, the workflow lint, the
# CUDA simulator and Triton, or the study, report and ring commands, which run no C
# code of their own and start Chromium, pdftoppm and fresh interpreters that the
# preloaded runtime would follow) against the sanitizer build, every ISA the CPU has; run from $(SAN)
# so the source tree does not shadow the installed build.
test-sanitize: sanitize
	cd $(SAN) && ../tools/sanitized venv/bin/python -m pytest -m "not slow" -p no:cacheprovider \
		--rootdir=.. -c ../pyproject.toml ../tests --ignore=../tests/test_workflows.py \
		--ignore=../tests/test_cuda.py --ignore=../tests/test_asv.py --ignore=../tests/test_cuda_backward.py \
		--ignore=../tests/test_study.py --ignore=../tests/test_report.py --ignore=../tests/test_ring.py \
		--ignore=../tests/test_triton.py

# Coverage-guided fuzzing (Atheris) of attention() and the Cython entry points on
# the sanitizer build, time-boxed; new interesting inputs go to $(SAN)/corpus.
FUZZ_SECONDS ?= 120
fuzz: sanitize
	mkdir -p $(SAN)/corpus
	cd $(SAN) && ../tools/sanitized --fuzzer venv/bin/python ../tests/fuzz/fuzz_attention.py \
		-max_total_time=$(FUZZ_SECONDS) -max_len=4096 -print_final_stats=1 corpus ../tests/fuzz/corpus

clean:
	rm -rf $(VENV) build bench-results .asv .gate $(SAN)
