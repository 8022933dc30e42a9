# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv from this project's files.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint clean servers servers-down

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

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check trainforge tests bench

clean:
	rm -rf $(VENV) build *.egg-info

# The production server stack on loopback (PostgreSQL, SeaweedFS S3, MLflow, Prefect); `make servers-down` stops it.
servers: $(STAMP)
	$(BIN)/trainforge servers up

servers-down: $(STAMP)
	$(BIN)/trainforge servers down
