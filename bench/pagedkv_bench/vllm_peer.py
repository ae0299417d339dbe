"""vLLM's CPU backend as a peer: its worker run in vLLM's own virtualenv, as a subprocess.

vLLM pins its own dependencies, so it lives in ``.venv-vllm`` (``make vllm-install``), never in
pagedkv's environment. :class:`VllmPeer` starts :mod:`pagedkv_bench.vllm_worker` with that
interpreter, which loads the model once and then times one run per message, so the caller can
interleave vLLM's runs with the other systems' (SRV-104): it is a
:class:`~pagedkv.bench.system.SystemUnderTest` like them. Where that interpreter does not
exist, or the worker fails, :class:`PeerUnavailable` says why and the caller records it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from pagedkv.bench.requests import BenchRequest
from pagedkv.bench.run import RunResult

#: Environment variable naming the Python interpreter that has vLLM installed.
PYTHON_ENV = "PAGEDKV_VLLM_PYTHON"
#: Where ``make vllm-install`` puts that interpreter, relative to the working directory.
DEFAULT_PYTHON = Path(".venv-vllm") / "bin" / "python"
#: vLLM's CPU backend needs a block size that is a multiple of 32.
BLOCK_SIZE = 32
#: The peer's name in the results.
VLLM_CPU = "vllm-cpu"
#: Longest the worker may take to load the model, or to answer one row (warm-up included),
#: seconds.
TIMEOUT_S = 1800


class PeerUnavailable(Exception):
    """vLLM could not be run; the message says why (shown in the results' notes)."""


def vllm_python() -> Path:
    """The interpreter of vLLM's virtualenv: ``$PAGEDKV_VLLM_PYTHON``, else ``.venv-vllm``'s."""
    configured = os.environ.get(PYTHON_ENV)
    return Path(configured) if configured else DEFAULT_PYTHON


class VllmPeer:
    """One vLLM CPU engine on ``model_dir`` in its worker process, until :meth:`close`.

    Args:
        model_dir: the checkpoint.
        dtype: ``float32`` or ``bfloat16``.
        threads: OpenMP threads of the worker.
        max_model_len: longest sequence, positions.
        max_num_seqs: most requests of one row.
        kv_cache_gib: vLLM's KV cache space, GiB.
        max_num_batched_tokens: the step budget, positions (SRV-048).
        name: the system's name in the results.

    Raises:
        PeerUnavailable: no vLLM interpreter, or the worker failed to load the model.
    """

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        *,
        threads: int,
        max_model_len: int,
        max_num_seqs: int,
        kv_cache_gib: int,
        max_num_batched_tokens: int,
        name: str = VLLM_CPU,
    ) -> None:
        self.name = name
        python = vllm_python()
        if not python.is_file():
            raise PeerUnavailable(
                f"no vLLM interpreter at {python} (run `make vllm-install`, or set {PYTHON_ENV})"
            )
        env = dict(os.environ)
        # The worker's interpreter imports this package from the folder that holds it, as
        # this process did (vLLM's virtualenv does not install it).
        path = [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in path if p),
            OMP_NUM_THREADS=str(threads),
            VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
            TOKENIZERS_PARALLELISM="false",
        )
        # vLLM logs freely: to a file, so that a full pipe can never stall the worker. It
        # lives as long as the worker, closed by close().
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._process = subprocess.Popen(
            [str(python), "-m", "pagedkv_bench.vllm_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        setup = {
            "model": str(model_dir),
            "dtype": dtype,
            "block_size": BLOCK_SIZE,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
        }
        try:
            self.version = str(self._ask(setup).get("vllm"))
        except PeerUnavailable:
            self.close()
            raise

    def run(self, requests: Sequence[BenchRequest]) -> RunResult:
        """One timed run of ``requests``, after an untimed one the first time they come.

        Several requests are a batch: all submitted at once, timed over the whole call
        (prefill included); the result has no per-request times. One request is a batch-1
        decode: vLLM's offline API reports no per-token times, so the request runs once for
        its ``max_tokens`` and once for one token, and the difference of the two is its decode
        time (prefill excluded); the result's wall time is the full run's.

        Raises:
            PeerUnavailable: the worker failed or ran past :data:`TIMEOUT_S`.
        """
        job = {
            "kind": "decode" if len(requests) == 1 else "batch",
            "requests": [[list(r.prompt), r.max_tokens] for r in requests],
        }
        answer = self._ask(job)
        decoded = "decode_s" in answer
        return RunResult(
            system=self.name,
            output_tokens=int(answer["output_tokens"]),
            wall_s=float(answer["wall_s"]),
            ttft_s=(),
            decode_s=(float(answer["decode_s"]),) if decoded else (),
            decode_tokens=(int(answer["decode_tokens"]),) if decoded else (),
        )

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one line, read the worker's one-line answer."""
        stdin, stdout = self._process.stdin, self._process.stdout
        if stdin is None or stdout is None:
            raise PeerUnavailable("the vLLM worker has no pipes")
        try:
            stdin.write(json.dumps(message) + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._failure("the vLLM worker ended") from exc
        # The worker writes one line per message and nothing else, so nothing is left in the
        # reader's buffer between answers and select sees every one on the pipe.
        ready, _, _ = select.select([stdout], [], [], TIMEOUT_S)
        if not ready:
            raise self._failure(f"the vLLM worker ran past {TIMEOUT_S} s")
        line = stdout.readline()
        if not line:
            raise self._failure(f"the vLLM worker exited with {self._process.wait()}")
        try:
            answer: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as exc:
            raise self._failure(f"the vLLM worker answered {line[:200]!r}") from exc
        return answer

    def _failure(self, what: str) -> PeerUnavailable:
        """``what``, with the last lines the worker logged; the worker is ended."""
        self._end()
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        self._log.close()
        return PeerUnavailable(f"{what}: {' | '.join(lines[-3:])}")

    def close(self) -> None:
        """End the worker (its standard input closed; killed if it does not exit in a
        minute) and drop its log. Idempotent."""
        self._end()
        self._log.close()

    def _end(self) -> None:
        if self._process.stdin is not None and not self._process.stdin.closed:
            with contextlib.suppress(OSError):  # the worker is gone already
                self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
