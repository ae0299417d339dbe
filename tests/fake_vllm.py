"""A stand-in for vLLM's virtualenv: an interpreter whose ``vllm`` is a small fake module, so
the real worker (:mod:`pagedkv_bench.vllm_worker`) runs in a real subprocess over its real pipe
protocol without vLLM.

The fake ``LLM`` prints a log line to standard output while loading (as vLLM does), writes the
arguments it was built with to ``$FAKE_VLLM_MADE``, appends one line per ``generate`` call (how
many prompts) to ``$FAKE_VLLM_CALLS``, and generates exactly ``max_tokens`` zeros per prompt,
taking 2 ms per token of the longest; with ``$FAKE_VLLM_FAIL`` set, ``generate`` raises that
text.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedkv_bench import peers, vllm_peer

FAKE_MODULE = """
import json, os, time
from types import SimpleNamespace

__version__ = "0.0-fake"


def SamplingParams(**kwargs):
    return kwargs


class LLM:
    def __init__(self, **kwargs):
        print("INFO the fake engine is loading")  # as vLLM logs to standard output
        with open(os.environ["FAKE_VLLM_MADE"], "w") as f:
            json.dump(kwargs, f)

    def reset_prefix_cache(self):
        return True

    def generate(self, prompts, params, use_tqdm):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError(os.environ["FAKE_VLLM_FAIL"])
        with open(os.environ["FAKE_VLLM_CALLS"], "a") as f:
            f.write(f"{len(prompts)}\\n")
        time.sleep(0.002 * max(p["max_tokens"] for p in params))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * p["max_tokens"])])
                for p in params]
"""


def fake_vllm_interpreter(monkeypatch: pytest.MonkeyPatch, folder: Path) -> Path:
    """Point the peer at an interpreter that imports the fake ``vllm`` from ``folder``; the
    file where the fake ``LLM`` records its arguments (``folder/made.json``)."""
    package = folder / "fake-site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_MODULE)
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(python))
    monkeypatch.setenv("PYTHONPATH", str(folder / "fake-site"))
    monkeypatch.setenv("FAKE_VLLM_MADE", str(folder / "made.json"))
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(folder / "calls.txt"))
    return folder / "made.json"


def small_peer(model_dir: Path = Path("unused")) -> vllm_peer.VllmPeer:
    """A peer of one thread and a small engine, with the peers workload's step budget."""
    return vllm_peer.VllmPeer(
        model_dir,
        "float32",
        threads=1,
        max_model_len=64,
        max_num_seqs=2,
        kv_cache_gib=1,
        max_num_batched_tokens=peers.STEP_TOKENS,
    )
