# pagedkv — every target sets itself up: `make test` alone works from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; override (e.g. TORCH_SPEC='torch>=2.4') on a machine with CUDA.
TORCH_SPEC ?= torch==2.13.0
# module:factory of the backend `make conformance` tests; empty means pagedkv's reference.
BACKEND ?=
CONFORMANCE_ARGS := --pyargs pagedkv_conformance $(if $(BACKEND),--backend $(BACKEND))

.PHONY: install demo test conformance typecheck lint clean bench bench-gate mutation

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# The radix prefix index is held to the whole suite but the golden checks against transformers
# (which never reach a prefix hit; the engine's real-model cases do), the KV state machine
# included: it declares orphans=detach (KVM-050) and the oracle follows it.
RADIX_SUITES := pagedkv_conformance.test_kv_manager pagedkv_conformance.test_kv_state_machine \
	pagedkv_conformance.test_kv_variants pagedkv_conformance.test_paged_store \
	pagedkv_conformance.test_engine pagedkv_conformance.test_engine_state_machine \
	pagedkv_conformance.test_engine_model pagedkv_conformance.test_engine_text

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

# Mutation testing of the reference (mutmut, installed here): kv/, the PagedStore and engine/,
# one package at a time with targeted tests (scripts/mutation.py); prints the score per
# package and every survivor, with the reason for those triaged as equivalent
# (conformance/mutation-equivalents.toml). Not part of `make test`: about half an hour on 2 cores.
MUTMUT_SPEC ?= mutmut==3.8.1
mutation: install
	$(BIN)/pip install --quiet "$(MUTMUT_SPEC)"
	$(BIN)/python scripts/mutation.py $(MUTATION_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build/mutation
