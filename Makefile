# pagedkv — every target sets itself up: `make test` alone works from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; override (e.g. TORCH_SPEC='torch>=2.4') on a machine with CUDA.
TORCH_SPEC ?= torch==2.13.0
# module:factory of the backend `make conformance` tests; empty means pagedkv's reference.
BACKEND ?=
CONFORMANCE_ARGS := --pyargs pagedkv_conformance $(if $(BACKEND),--backend $(BACKEND))

.PHONY: install test conformance typecheck lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

test: install
	$(BIN)/pytest tests
	$(BIN)/pytest $(CONFORMANCE_ARGS)

conformance: install
	$(BIN)/pytest $(CONFORMANCE_ARGS)

typecheck: install
	$(BIN)/mypy --strict src conformance

lint: install
	$(BIN)/ruff check src conformance tests
	$(BIN)/ruff format --check src conformance tests

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
