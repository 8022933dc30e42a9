# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv from this project's files.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: venv demo test test-fast test-pure lint clean servers servers-down stack stack-down debian-deps

# What `make demo` needs: the project and its `trainer` extra (the job's workers, the quality gate). The rest of
# the development set (the test servers' clients, Kubernetes, the browser and Hugging Face checks) comes with
# `make venv` / `make test`: the demo does not wait for it (74 s of the install on 2 cores, bench/demo_phases.py).
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# pip 23 (Python 3.11's) takes 37 s to resolve the demo's set on 2 cores, a current pip 13 s
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch first, so nothing pulls a CUDA build (any torch>=2.13 works elsewhere).
	$(BIN)/pip install --quiet --no-compile "torch==2.13.0"
	$(BIN)/pip install --quiet --no-compile -e ".[trainer]"
	# pip compiles each file as it installs it, on one core (47 s of the install on 2 cores); compileall on every
	# core takes 30 s, and compiles the project's own modules too (an editable install leaves them to each process).
	# Some packages ship files no Python 3 compiles (aenum's _py2.py): pip skips them too, so their errors do not count.
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib trainforge || true
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/trainforge demo

# Debian packages the tests use (PostgreSQL; chromium + chromium-driver for tests/browser) through
# scripts/setup-debian.sh, which installs only what is missing (a no-op when all is there). It installs when we are
# root on a Debian system with apt; otherwise it only reports, and the browser test skips saying why (unless
# TRAINFORGE_REQUIRE_BROWSER=1, as in the CI, makes that an error). SETUP_DEBIAN=0 skips the step.
SETUP_DEBIAN ?= 1
debian-deps:
	@if [ "$(SETUP_DEBIAN)" != 1 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "debian-deps: skipped (SETUP_DEBIAN=$(SETUP_DEBIAN), apt-get $$(command -v apt-get || echo absent))"; \
	elif [ "$$(id -u)" = 0 ]; then scripts/setup-debian.sh; \
	else scripts/setup-debian.sh --check || echo "debian-deps: not root, nothing installed (see above)"; fi

# The whole suite (what the CI runs): scripts/test-suite runs everything but the `timing` tests on xdist workers,
# then the `timing` tests alone. Every test target holds the machine's test lock (scripts/test-lock): one run per
# machine, a second waits. Arguments for pytest: make test ARGS="tests/integration -x".
test: $(STAMP) debian-deps
	scripts/test-lock "make test" scripts/test-suite $(ARGS)

# The inner loop while changing code (<= 3 min on 2 cores): everything that starts no torchrun, training process,
# Python subprocess or server (unit, spec, planner, scheduler, render, docs, layering), hypothesis on 10 examples.
# Such a start fails the test here (tests/fixtures/suite.py): mark it `slow` and it runs in `make test`.
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	scripts/test-lock "make test-fast" env TRAINFORGE_TEST_FAST=1 TRAINFORGE_HYPOTHESIS_PROFILE=fast \
	  $(BIN)/python -m pytest -q -n $(FAST_WORKERS) -m "not slow and not timing and not gpu" --durations=10 $(ARGS)

# The pure parts (spec, validate, plan, simulate, render) under another interpreter, in a venv of their own with
# tests/requirements-pure.txt only: no torch (its CPU wheel here is for 3.11), no prefect, no mlflow, so a pure module
# that imported one of them fails here instead of skipping.  make test-pure PY=python3.12
PURE_TESTS := tests/unit/test_spec.py tests/unit/test_validate.py tests/unit/plan tests/unit/scheduler \
	tests/unit/k8s/test_render.py tests/unit/test_optional.py tests/unit/test_resources.py
PURE_VER = $(shell $(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
PURE_VENV = .venv-pure-$(PURE_VER)
test-pure:
	@test -n "$(PURE_VER)" || { echo "test-pure: $(PY) does not run (give PY=/path/to/python3.X)"; exit 2; }
	@if [ ! -f $(PURE_VENV)/.installed ] || [ tests/requirements-pure.txt -nt $(PURE_VENV)/.installed ]; then \
	  rm -rf $(PURE_VENV) && $(PY) -m venv $(PURE_VENV) && \
	  $(PURE_VENV)/bin/pip install --quiet -r tests/requirements-pure.txt && touch $(PURE_VENV)/.installed; fi
	@! $(PURE_VENV)/bin/python -c 'import torch' 2>/dev/null || { echo "test-pure: torch is in $(PURE_VENV)"; exit 1; }
	scripts/test-lock "make test-pure ($(PURE_VER))" $(PURE_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  $(PURE_TESTS) --ignore=tests/unit/plan/test_deepspeed_parity.py

lint: $(STAMP)
	$(BIN)/ruff check trainforge tests bench

clean:
	rm -rf $(VENV) .venv-pure-* build *.egg-info

# The production server stack on loopback (PostgreSQL, SeaweedFS S3, MLflow, Prefect); `make servers-down` stops it.
servers: $(STAMP)
	$(BIN)/trainforge servers up

servers-down: $(STAMP)
	$(BIN)/trainforge servers down

# The names the production docs use: `make stack` = `trainforge up`, `make stack-down` = `trainforge down`.
stack: servers
stack-down: servers-down
