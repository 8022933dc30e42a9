# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv from this project's files.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint clean servers servers-down stack stack-down debian-deps

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch first, so nothing pulls a CUDA build (any torch>=2.13 works elsewhere).
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
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

test: $(STAMP) debian-deps
	$(BIN)/python -m pytest -q --durations=30

lint: $(STAMP)
	$(BIN)/ruff check trainforge tests bench

clean:
	rm -rf $(VENV) build *.egg-info

# The production server stack on loopback (PostgreSQL, SeaweedFS S3, MLflow, Prefect); `make servers-down` stops it.
servers: $(STAMP)
	$(BIN)/trainforge servers up

servers-down: $(STAMP)
	$(BIN)/trainforge servers down

# The names the production docs use: `make stack` = `trainforge up`, `make stack-down` = `trainforge down`.
stack: servers
stack-down: servers-down
