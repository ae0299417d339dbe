"""Detokenization cost of one long output: a full decode per token against the incremental
detokenizer (specs/engine.md ENG-092).

The baseline is how pagedkv detokenized before: after each token, decode the whole output and
search the new text for stop strings, O(n) per token and O(n²) per output. The incremental
detokenizer steps the ``tokenizers`` library's ``DecodeStream`` (or, for a tokenizer without
one, decodes the few tokens since the last released text) and checks stop strings only in the
new text: O(1) per token. Both run on the small model's tokenizer over the same output (its
encoding of the standard library's ``json.decoder`` source, repeated to the length), with one
stop string that never occurs, as a request with a stop string would; the ratio is their time
per output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import median, ratio, rounded
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.tokenizer import Tokenizer

#: Output lengths measured, tokens (the last is the headline).
FULL_LENGTHS = (256, 512, 1024, 2048)
QUICK_LENGTHS = (256, 512)
REPETITIONS = 3
#: A stop string that never occurs: every step searches for it, none ends the output.
STOP = "\x00never"


def full_decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The baseline: the whole output decoded again after every token, the stop string
    searched in the text each new token may have completed."""
    text = ""
    for end in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:end])
        if full.endswith("\ufffd"):
            continue
        full.find(STOP, max(0, len(text) - len(STOP) + 1))
        text = full
    return text


def incremental(tokenizer: Tokenizer, ids: Sequence[int], window: bool = False) -> str:
    """The engine's detokenizer, one token per step, releasing text as a stream would
    (``window``: the sliding-window decoder instead of ``DecodeStream``)."""
    detokenizer = IncrementalDetokenizer(
        tokenizer.incremental_decoder(window=window), SamplingParams(stop=(STOP,))
    )
    released = []
    for token in ids:
        detokenizer.update([token])
        released.append(detokenizer.release(finished=False))
    released.append(detokenizer.release(finished=True))
    return "".join(released)


def output_tokens(tokenizer: Tokenizer, length: int) -> list[int]:
    """``length`` tokens of Python source (the standard library's ``json.decoder``, repeated)
    as the tokenizer encodes it."""
    import json.decoder

    ids = tokenizer.encode(Path(json.decoder.__file__).read_text(encoding="utf-8"))
    return (ids * (length // len(ids) + 1))[:length]


def timed(
    function: Callable[[Tokenizer, Sequence[int]], str], tokenizer: Tokenizer, ids: Sequence[int]
) -> float:
    """The fastest of :data:`REPETITIONS` runs, seconds."""
    best = float("inf")
    for _ in range(REPETITIONS):
        start = time.perf_counter()
        function(tokenizer, ids)
        best = min(best, time.perf_counter() - start)
    return best


def run(ctx: BenchContext, checkpoint: Checkpoint) -> WorkloadResult:
    result = WorkloadResult("detokenize")
    tokenizer = Tokenizer(checkpoint.path)
    lengths = QUICK_LENGTHS if ctx.quick else FULL_LENGTHS
    rows: dict[str, dict[str, float | None]] = {}
    speedups = []
    for length in lengths:
        ids = output_tokens(tokenizer, length)
        if full_decode(tokenizer, ids) != incremental(tokenizer, ids):
            result.errors[f"{length}"] = "the incremental text differs from the full decode"
        before = timed(full_decode, tokenizer, ids)
        after = timed(incremental, tokenizer, ids)
        window = timed(partial(incremental, window=True), tokenizer, ids)
        ctx.log(f"detokenize: {length} tokens: {before:.3f} s -> {after:.4f} s")
        rows[str(length)] = {
            "full_decode_s": rounded(before),
            "decode_stream_s": rounded(after, 5),
            "window_decoder_s": rounded(window, 5),
            "speedup": rounded(ratio(before, after)),
        }
        speedups.append(ratio(before, after))
    result.figures["by_output_tokens"] = rows
    headline = lengths[-1]
    result.add_ratio(
        "incremental_vs_full_decode",
        speedups[-1],
        f"seconds to detokenize one {headline}-token output by a full decode per token over "
        "the incremental detokenizer (DecodeStream), stop string checked",
    )
    growth = ratio(
        float(rows[str(lengths[-1])]["decode_stream_s"] or 0.0),
        float(rows[str(lengths[0])]["decode_stream_s"] or 0.0),
    )
    result.add_ratio(
        "incremental_cost_growth",
        growth,
        f"incremental time for {lengths[-1]} tokens over {lengths[0]} tokens: "
        f"{lengths[-1] // lengths[0]} means O(1) per token",
    )
    result.notes.append(f"median speedup over the lengths: {median(speedups):.1f}x")
    return result
