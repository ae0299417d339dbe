"""pagedkv beside the engines a user would pick instead, on the Qwen3-0.6B shape (full mode).

Rows, in float32 and bfloat16: batch-1 decode (decode tokens/s, prefill excluded) and batches
of 8 and 32 requests submitted at once (output tokens/s over the wall time, prefill included),
every request with a 128-token prompt; and the long-context row (ENG-213), batch-1 decode after
a 4,096-token prompt. Every request generates exactly 64 tokens, greedy, EOS ignored.

Systems: pagedkv v1; transformers ``generate`` on one static batch of all the requests (equal
lengths: no padding, its best case; not on the long-context row); vLLM's CPU backend, run from
its own virtualenv as a subprocess (:mod:`pagedkv_bench.vllm_peer`); llama.cpp's
``llama-batched-bench`` on a GGUF of the same checkpoint (:mod:`pagedkv_bench.llamacpp_peer`,
ENG-210); each peer skipped with the reason when it cannot run. All use the run's threads, and
the engines one step budget of 4096 positions (SRV-048). Each system runs each row at least
:data:`REPEATS` times after a warm-up, and as many times as systems run the row (ENG-211), and
reports its median, every repetition kept under ``samples``; each ratio is the median over
repetitions of the ratio within one (SRV-104), as the decode and mixed workloads take theirs.
The systems are loaded side by side (vLLM in its own process, with its own copy of the
weights; llama.cpp in a process per run, its weights mapped from the GGUF) and take turns run
by run, the order rotating so that each leads one repetition of every row, so that a slow
phase of the machine falls on all of them rather than on whichever ran then.

The batched float32 rows also report the fraction of the machine's GEMM peak (a float32 matrix
product measured in the run) that pagedkv reached, counting ``2 x parameters`` operations per
position computed, the embedding table only for the LM head of the positions sampled.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from pagedkv.bench.checkpoints import QWEN3_0_6B, Checkpoint, qwen3_shaped_checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.hf_systems import HF_GENERATE, HfGenerate, load_hf_model
from pagedkv.bench.limits import gemm_peak_flops
from pagedkv.bench.pagedkv_system import PAGE_SIZE, PagedkvSystem, load_runner, make_engine, warm_up
from pagedkv.bench.requests import BenchRequest, uniform_requests
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import median, ratio, rounded
from pagedkv.bench.system import SystemUnderTest
from pagedkv.engine.runner import ModelRunner
from pagedkv_bench.llamacpp_peer import LLAMA_CPP, LlamaCppPeer
from pagedkv_bench.vllm_peer import VLLM_CPU, PeerUnavailable, VllmPeer

PROMPT_LEN = 128
#: The long-context row's prompt (ENG-213), tokens.
LONG_PROMPT_LEN = 4096
NEW_TOKENS = 64
BATCH_SIZES = (8, 32)
DTYPES = ("float32", "bfloat16")
#: pagedkv over transformers static batching, batched float32 rows.
HF_BATCH_TARGET = 1.5
#: Positions per step, every engine (SRV-048): vLLM's CPU default for its offline ``LLM``,
#: given to vLLM explicitly and to pagedkv's engine.
STEP_TOKENS = 4096
#: Timed runs of each row on each system (SRV-104): one run of a row moves between full runs
#: on one machine by more than some rows' margin over their target (bench/README.md).
REPEATS = 3
#: pagedkv over vLLM's CPU backend, every row.
VLLM_TARGET = 1.0
#: pagedkv over llama.cpp, every row (the median of the paired ratios) ...
LLAMA_CPP_TARGET = 1.0
#: ... and, on the batch-1 decode rows, every repetition's paired ratio.
LLAMA_CPP_LOWEST_TARGET = 0.9
#: Longest sequence of any row, positions (the engines' ``max_model_len``).
MAX_MODEL_LEN = LONG_PROMPT_LEN + NEW_TOKENS + 16
PAGEDKV, HF, VLLM = "pagedkv", HF_GENERATE, VLLM_CPU
#: Each peer's name in the ratios.
PEER_LABELS = ((HF, "hf_generate"), (VLLM, "vllm_cpu"), (LLAMA_CPP, "llama_cpp"))


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the table: a dtype, a batch size (1: a decode row) and a prompt length
    (:data:`LONG_PROMPT_LEN`: the long-context row)."""

    dtype: str
    batch: int
    prompt_len: int = PROMPT_LEN

    @property
    def name(self) -> str:
        short = "fp32" if self.dtype == "float32" else "bf16"
        if self.prompt_len != PROMPT_LEN:
            return f"{short}_decode_long"
        return f"{short}_decode" if self.batch == 1 else f"{short}_bs{self.batch}"

    @property
    def metric(self) -> str:
        return "decode_tokens_per_s" if self.batch == 1 else "output_tokens_per_s"

    def runs_on(self, system: str) -> bool:
        """Whether ``system`` runs this row: transformers ``generate`` not the long-context
        row (ENG-213), whose dense prefill of 4,096 positions would take most of the
        workload's time to measure no engine."""
        return not (system == HF and self.prompt_len != PROMPT_LEN)

    def requests(self, vocab: int, seed: int) -> list[BenchRequest]:
        return uniform_requests(self.batch, self.prompt_len, NEW_TOKENS, vocab, seed + self.batch)


def rows() -> list[Row]:
    """Every row, dtype by dtype: batch-1 decode, the batches, the long-context row."""
    return [
        row
        for d in DTYPES
        for row in (*(Row(d, b) for b in (1, *BATCH_SIZES)), Row(d, 1, LONG_PROMPT_LEN))
    ]


def kv_positions() -> int:
    """Positions the largest row holds at its end, all its sequences together."""
    return max(r.batch * (r.prompt_len + NEW_TOKENS) for r in rows())


def run(ctx: BenchContext) -> WorkloadResult:
    """Every row on every system that runs here, then the ratios and targets."""
    result = WorkloadResult("peers")
    checkpoint = qwen3_shaped_checkpoint(ctx.cache_dir)
    vocab = QWEN3_0_6B.vocab
    samples: Samples = {r.name: {} for r in rows()}
    for dtype in DTYPES:
        dtype_rows = [r for r in rows() if r.dtype == dtype]
        peer = _vllm(ctx, result, checkpoint, dtype)
        llama = _llama_cpp(ctx, result, checkpoint, dtype)
        try:
            _measure_rows(ctx, result, checkpoint, dtype_rows, vocab, samples, peer, llama)
        except Exception as exc:  # recorded: one dtype failing must not lose the other
            result.errors[dtype] = f"{type(exc).__name__}: {exc}"
        finally:
            if peer is not None:
                peer.close()
        gc.collect()
    figures = medians(samples)
    result.figures = settings_and_rows(checkpoint.name, ctx.threads, figures, samples)
    if ctx.device == "cpu":
        peak = gemm_peak_flops()
        result.figures["gemm_peak_gflop_per_s"] = rounded(peak / 1e9, 1)
        for batch in BATCH_SIZES:
            row = Row("float32", batch)
            achieved = _achieved_flops(row, figures[row.name].get(PAGEDKV))
            result.add_ratio(
                f"{row.name}_fraction_of_gemm_peak",
                ratio(achieved, peak),
                f"float32, {batch} requests: pagedkv's model FLOP/s (2 x parameters per "
                "position computed) over a float32 GEMM's measured FLOP/s",
            )
    _ratios(result, samples)
    return result


#: Each row's tokens/s on each system, one value per timed repetition.
Samples = dict[str, dict[str, list[float]]]


def medians(samples: Samples) -> dict[str, dict[str, float | None]]:
    """Each row's figure on each system: the median of its repetitions (SRV-104)."""
    return {
        row: {system: rounded(median(values), 3) for system, values in by_system.items()}
        for row, by_system in samples.items()
    }


def settings_and_rows(
    checkpoint: str,
    threads: int,
    rows: dict[str, dict[str, float | None]],
    samples: Samples | None = None,
) -> dict[str, object]:
    """The workload's figures: its settings (the step budget among them, SRV-048, and the
    repetitions, SRV-104), each row's tokens/s by system and, where given, every repetition's."""
    return {
        "checkpoint": checkpoint,
        "prompt_len": PROMPT_LEN,
        "long_prompt_len": LONG_PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "step_tokens": STEP_TOKENS,
        "threads": threads,
        "repeats": REPEATS,
        "rows": rows,
        "samples": samples or {},
    }


def _vllm(
    ctx: BenchContext, result: WorkloadResult, checkpoint: Checkpoint, dtype: str
) -> VllmPeer | None:
    """vLLM's CPU backend on ``checkpoint`` in ``dtype``, loaded; ``None`` (and a note of
    why) where it cannot run."""
    if ctx.device != "cpu":
        result.notes.append("vLLM CPU: not run with --device cuda (it is a CPU backend)")
        return None
    ctx.log(f"peers: {dtype}: loading vLLM CPU backend (subprocess)")
    itemsize = 4 if dtype == "float32" else 2
    shape = QWEN3_0_6B
    per_position = 2 * shape.layers * shape.kv_heads * shape.head_dim * itemsize
    kv_bytes = per_position * kv_positions()
    try:
        peer = VllmPeer(
            checkpoint.path,
            dtype,
            threads=ctx.threads,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=max(BATCH_SIZES),
            kv_cache_gib=max(1, -(-2 * kv_bytes // 2**30)),  # twice what the rows hold
            max_num_batched_tokens=STEP_TOKENS,
        )
    except PeerUnavailable as exc:
        result.notes.append(f"vLLM CPU ({dtype}) not measured: {exc}")
        return None
    result.figures.setdefault("vllm_version", peer.version)
    return peer


def _llama_cpp(
    ctx: BenchContext, result: WorkloadResult, checkpoint: Checkpoint, dtype: str
) -> LlamaCppPeer | None:
    """llama.cpp on ``checkpoint``'s GGUF in ``dtype`` (written first if absent: minutes);
    ``None`` (and a note of why) where it cannot run (ENG-210)."""
    if ctx.device != "cpu":
        result.notes.append("llama.cpp: not run with --device cuda (the build is the CPU's)")
        return None
    ctx.log(f"peers: {dtype}: preparing llama.cpp (its GGUF is converted once)")
    try:
        peer = LlamaCppPeer(checkpoint.path, dtype, threads=ctx.threads, batch_tokens=STEP_TOKENS)
    except PeerUnavailable as exc:
        result.notes.append(f"llama.cpp ({dtype}) not measured: {exc}")
        return None
    result.figures.setdefault("llama_cpp_gguf", {})[dtype] = peer.gguf.name
    return peer


def _measure_rows(
    ctx: BenchContext,
    result: WorkloadResult,
    checkpoint: Checkpoint,
    dtype_rows: list[Row],
    vocab: int,
    samples: Samples,
    peer: SystemUnderTest | None,
    llama: SystemUnderTest | None = None,
) -> None:
    """Every row of one dtype on each system that runs it, :data:`REPEATS` times or as many
    times as those systems (ENG-211), taking turns in an order that rotates run by run so
    that each leads one repetition. A peer leaves the rotation (a note says why) if it fails."""
    dtype = dtype_rows[0].dtype
    ctx.log(f"peers: {dtype}: loading pagedkv and transformers")
    num_pages = max(r.batch * -(-(r.prompt_len + NEW_TOKENS) // PAGE_SIZE) for r in rows()) + 16
    runner = load_runner(checkpoint, num_pages, dtype=dtype, device=ctx.device)
    hf = HfGenerate(load_hf_model(checkpoint, dtype, ctx.device))
    # Two requests decoding together: a 16-bit pool compiles its fused decode attention
    # (PST-008) here, not inside the first batched row.
    warm_up(make_engine(runner, "v1", num_pages), vocab)
    hf.run([BenchRequest(tuple(range(1, 9)), 3)])
    systems: list[SystemUnderTest] = [pagedkv_system(runner, num_pages), hf]
    systems += [p for p in (peer, llama) if p is not None]
    for row in dtype_rows:
        requests = row.requests(vocab, ctx.seed)
        taking_part = [s for s in systems if row.runs_on(s.name)]
        repeats = max(REPEATS, len(taking_part))
        for repeat in range(repeats):
            turn = repeat % len(taking_part)
            for system in taking_part[turn:] + taking_part[:turn]:
                if system not in systems:  # it failed earlier in this repetition
                    continue
                ctx.log(f"peers: {row.name}: {system.name} ({repeat + 1}/{repeats})")
                try:
                    run = system.run(requests)
                except PeerUnavailable as exc:  # the peer failed: it leaves the rotation
                    result.notes.append(f"{system.name} ({row.dtype}) stopped at {row.name}: {exc}")
                    systems.remove(system)
                    continue
                value = run.decode_tokens_per_s if row.batch == 1 else run.tokens_per_s
                samples[row.name].setdefault(system.name, []).append(value)
    del runner, hf, systems


def pagedkv_system(runner: ModelRunner, num_pages: int) -> PagedkvSystem:
    """pagedkv v1 on ``runner``, with the step budget of every engine here (SRV-048)."""
    return PagedkvSystem(
        PAGEDKV,
        lambda: make_engine(
            runner,
            "v1",
            num_pages,
            max_num_batched_tokens=STEP_TOKENS,
            max_model_len=MAX_MODEL_LEN,
        ),
    )


def _achieved_flops(row: Row, tokens_per_s: float | None) -> float:
    """Model FLOP/s of a batched row: its operations over its wall time."""
    if tokens_per_s is None:
        return float("nan")
    shape = QWEN3_0_6B
    hidden, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * shape.intermediate
    positions = row.batch * (PROMPT_LEN + NEW_TOKENS - 1)
    sampled = row.batch * NEW_TOKENS
    flops = 2 * (positions * shape.layers * per_layer + sampled * hidden * shape.vocab)
    wall = row.batch * NEW_TOKENS / tokens_per_s
    return flops / wall


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over repetitions of pagedkv's figure over a peer's in the same repetition
    (SRV-104: the systems of one repetition run back to back, so a slow phase of the machine
    falls on both terms of its ratio); over the repetitions both have; NaN if none."""
    return median([ratio(a, b) for a, b in zip(ours, theirs, strict=False)])


def lowest_paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The lowest of the repetitions' ratios (see :func:`paired_ratio`); NaN if none."""
    pairs = [ratio(a, b) for a, b in zip(ours, theirs, strict=False)]
    return min(pairs) if pairs else float("nan")


def _ratios(result: WorkloadResult, samples: Samples) -> None:
    for row in rows():
        values = samples[row.name]
        ours = values.get(PAGEDKV, [])
        what = "decode tokens/s" if row.batch == 1 else "output tokens/s (wall, prefill in)"
        where = f"{row.dtype}, {row.batch} request(s), prompt {row.prompt_len}"
        for peer, label in PEER_LABELS:
            if not row.runs_on(peer):
                continue
            result.add_ratio(
                f"{row.name}_pagedkv_vs_{label}",
                paired_ratio(ours, values.get(peer, [])),
                f"{where}: {what} of pagedkv over {peer}, the "
                "median over repetitions of each repetition's ratio",
            )
        result.add_target(
            f"{row.name}_pagedkv_vs_llama_cpp",
            ">=",
            LLAMA_CPP_TARGET,
            f"{row.name.replace('_', ' ')}: pagedkv >= {LLAMA_CPP_TARGET:.1f}x llama.cpp",
        )
        if row.batch == 1 and row.prompt_len == PROMPT_LEN:
            result.add_ratio(
                f"{row.name}_pagedkv_vs_llama_cpp_lowest",
                lowest_paired_ratio(ours, values.get(LLAMA_CPP, [])),
                f"{where}: {what} of pagedkv over llama.cpp, the lowest repetition's ratio",
            )
            result.add_target(
                f"{row.name}_pagedkv_vs_llama_cpp_lowest",
                ">=",
                LLAMA_CPP_LOWEST_TARGET,
                f"{row.name.replace('_', ' ')}: no repetition below "
                f"{LLAMA_CPP_LOWEST_TARGET}x llama.cpp",
            )
        if row.dtype == "float32" and row.batch > 1:
            result.add_target(
                f"{row.name}_pagedkv_vs_hf_generate",
                ">=",
                HF_BATCH_TARGET,
                f"float32, {row.batch} requests: pagedkv >= {HF_BATCH_TARGET}x transformers "
                "static batching",
            )
        result.add_target(
            f"{row.name}_pagedkv_vs_vllm_cpu",
            ">=",
            VLLM_TARGET,
            f"{row.name.replace('_', ' ')}: pagedkv >= {VLLM_TARGET:.1f}x vLLM CPU backend",
        )
