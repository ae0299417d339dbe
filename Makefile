# pagedkv — every target sets itself up: `make test` alone works from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; override (e.g. TORCH_SPEC='torch>=2.4') on a machine with CUDA.
TORCH_SPEC ?= torch==2.13.0
# module:factory of the backend `make conformance` tests; empty means pagedkv's reference.
BACKEND ?=
CONFORMANCE_ARGS := --pyargs pagedkv_conformance $(if $(BACKEND),--backend $(BACKEND))

.PHONY: install demo test conformance typecheck lint clean bench bench-gate

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# The radix prefix index is held to the KVManager examples and the engine suites; the KVManager
# state machine's oracle follows the chained-hash index where the spec leaves room (see README).
RADIX_SUITES := pagedkv_conformance.test_kv_manager pagedkv_conformance.test_kv_match \
	pagedkv_conformance.test_engine pagedkv_conformance.test_engine_observers \
	pagedkv_conformance.test_engine_state_machine

# The embedded model on a batch sharing a long system prompt, prefix caching on and off.
demo: install
	$(BIN)/pagedkv demo

test: install
	$(BIN)/pytest tests
	$(BIN)/pytest $(CONFORMANCE_ARGS)
	$(BIN)/pytest -q --pyargs $(RADIX_SUITES) --backend pagedkv.backend:radix_backend
	$(MAKE) bench-gate

conformance: install
	$(BIN)/pytest $(CONFORMANCE_ARGS)

typecheck: install
	$(BIN)/mypy --strict src conformance

lint: install
	$(BIN)/ruff check src conformance tests
	$(BIN)/ruff format --check src conformance tests

# Full benchmarks: bench/results.json, bench/results.md and PNG plots (several minutes; the first
# run also generates a 2.4 GB Qwen3-0.6B-shaped checkpoint in ~/.cache/pagedkv/bench).
bench: install $(VENV)/.bench-installed
	$(BIN)/python -m pagedkv.bench --out bench $(BENCH_ARGS)

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@

# CI regression gate: quick benchmarks, failing if a ratio is below its floor in bench/floors.json.
bench-gate: install
	$(BIN)/python -m pagedkv.bench --quick --out build/bench-quick --gate bench/floors.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
