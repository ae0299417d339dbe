"""vLLM's CPU backend as a peer: its worker run in vLLM's own virtualenv, as a subprocess.

vLLM pins its own dependencies, so it lives in ``.venv-vllm`` (``make vllm-install``), never in
pagedkv's environment. :func:`run_vllm` sends :mod:`pagedkv.bench.vllm_worker` a job on its
standard input and reads its JSON answer; where that interpreter does not exist, or the worker
fails, the caller records the reason and the peer's figures are ``None``.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Environment variable naming the Python interpreter that has vLLM installed.
PYTHON_ENV = "PAGEDKV_VLLM_PYTHON"
#: Where ``make vllm-install`` puts that interpreter, relative to the working directory.
DEFAULT_PYTHON = Path(".venv-vllm") / "bin" / "python"
#: vLLM's CPU backend needs a block size that is a multiple of 32.
BLOCK_SIZE = 32
#: Longest a worker may take (model load, warm-up and every row), seconds.
TIMEOUT_S = 3600


class PeerUnavailable(Exception):
    """vLLM could not be run; the message says why (shown in the results' notes)."""


@dataclass(frozen=True, slots=True)
class VllmRow:
    """One row of a job: its name, ``batch`` or ``decode``, and ``(prompt, max_tokens)``s."""

    name: str
    kind: str
    requests: tuple[tuple[tuple[int, ...], int], ...]


def vllm_python() -> Path:
    """The interpreter of vLLM's virtualenv: ``$PAGEDKV_VLLM_PYTHON``, else ``.venv-vllm``'s."""
    configured = os.environ.get(PYTHON_ENV)
    return Path(configured) if configured else DEFAULT_PYTHON


def run_vllm(
    model_dir: Path,
    dtype: str,
    rows: list[VllmRow],
    *,
    threads: int,
    max_model_len: int,
    kv_cache_gib: int,
    max_num_batched_tokens: int,
) -> dict[str, Any]:
    """Run ``rows`` on vLLM's CPU backend with ``threads`` OpenMP threads and a step budget of
    ``max_num_batched_tokens`` positions (SRV-048); the worker's answer
    (``{"rows": {name: figures}, "vllm": version}``).

    Raises:
        PeerUnavailable: no vLLM interpreter, or the worker failed or timed out.
    """
    python = vllm_python()
    if not python.is_file():
        raise PeerUnavailable(
            f"no vLLM interpreter at {python} (run `make vllm-install`, or set {PYTHON_ENV})"
        )
    job = {
        "model": str(model_dir),
        "dtype": dtype,
        "block_size": BLOCK_SIZE,
        "max_model_len": max_model_len,
        "max_num_seqs": max(len(r.requests) for r in rows),
        "max_num_batched_tokens": max_num_batched_tokens,
        "rows": [
            {"name": r.name, "kind": r.kind, "requests": [[list(p), n] for p, n in r.requests]}
            for r in rows
        ],
    }
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        TOKENIZERS_PARALLELISM="false",
    )
    try:
        done = subprocess.run(
            [str(python), "-m", "pagedkv.bench.vllm_worker"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise PeerUnavailable(f"the vLLM worker ran past {TIMEOUT_S} s") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise PeerUnavailable(f"the vLLM worker exited with {done.returncode}: {tail}")
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer
