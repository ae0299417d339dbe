"""Shared-prefix workloads: prompt positions computed and TTFT, prefix caching on and off.

* System prompt: ``N`` requests made of one shared prefix of ``L`` tokens and a short unique
  suffix each, on pagedkv v1 with prefix caching on and off, for several ``L``. Two arrival
  patterns: a *burst* (all requests at once, cold cache) and *sequential* (each request
  submitted when the previous finished). The ideal is the unique tokens only: the prefix once
  plus every suffix.
* Multi-turn chat: ``C`` conversations of ``T`` turns; turn ``k``'s prompt is turn ``k-1``'s
  prompt, its answer and a new user message. Ideal per turn after the first: the new message
  plus the previous answer's last token (the only positions without K/V). The page-granular
  ideal also recomputes the partial last page, which a page-granular cache cannot share.

Counts come from the engine's ``stats().prefill_tokens_computed`` (prompt positions the model
computed, recomputation included).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.pagedkv_system import (
    PAGE_SIZE,
    greedy_params,
    load_runner,
    make_engine,
    run_engine,
    warm_up,
)
from pagedkv.bench.requests import BenchRequest, random_tokens
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import median, ratio, rounded
from pagedkv.engine.runner import ModelRunner


@dataclass(frozen=True, slots=True)
class PrefixSpec:
    """Sizes of the shared-prefix workloads.

    Attributes:
        prefix_lens: shared prefix lengths swept, tokens.
        headline_len: the prefix length the headline ratios use, tokens.
        num_requests: requests sharing each prefix.
        suffix_low, suffix_high: unique suffix length range, tokens.
        output_len: tokens generated per request.
        chats: concurrent conversations.
        turns: turns per conversation.
        system_len: each conversation's own system prompt, tokens.
        user_low, user_high: user message length range, tokens.
        answer_len: tokens generated per turn.
    """

    prefix_lens: tuple[int, ...]
    headline_len: int
    num_requests: int
    suffix_low: int = 8
    suffix_high: int = 32
    output_len: int = 4
    chats: int = 2
    turns: int = 3
    system_len: int = 64
    user_low: int = 8
    user_high: int = 32
    answer_len: int = 16


QUICK = PrefixSpec(prefix_lens=(256,), headline_len=256, num_requests=8, chats=2, turns=3)
FULL = PrefixSpec(
    prefix_lens=(32, 64, 128, 256, 512), headline_len=256, num_requests=16, chats=4, turns=4
)


@dataclass(frozen=True, slots=True)
class PrefixRun:
    """One run of the system-prompt workload.

    Attributes:
        prefill: prompt positions computed.
        ideal: unique tokens: the prefix once plus every suffix.
        hit_tokens: prompt tokens served from the prefix cache.
        ttft_p50_s: median TTFT, seconds (sequential: requests after the first only).
    """

    prefill: int
    ideal: int
    hit_tokens: int
    ttft_p50_s: float

    def figures(self) -> dict[str, float | int | None]:
        return {
            "prefill_tokens_computed": self.prefill,
            "ideal_tokens": self.ideal,
            "computed_over_ideal": rounded(ratio(self.prefill, self.ideal)),
            "hit_tokens": self.hit_tokens,
            "ttft_p50_ms": rounded(self.ttft_p50_s * 1e3, 2),
        }


def prefix_requests(spec: PrefixSpec, prefix_len: int, vocab: int, seed: int) -> list[BenchRequest]:
    """``spec.num_requests`` requests: one shared prefix, then a unique suffix each."""
    rng = random.Random(seed * 1000 + prefix_len)
    prefix = random_tokens(rng, prefix_len, vocab)
    return [
        BenchRequest(
            prefix + random_tokens(rng, rng.randint(spec.suffix_low, spec.suffix_high), vocab),
            spec.output_len,
        )
        for _ in range(spec.num_requests)
    ]


def run(ctx: BenchContext, checkpoint: Checkpoint, vocab: int) -> WorkloadResult:
    """Sweep the prefix lengths with caching on and off, then run the chat."""
    result = WorkloadResult("shared_prefix")
    spec = QUICK if ctx.quick else FULL
    longest = max(spec.prefix_lens) + spec.suffix_high + spec.output_len
    chat_len = spec.system_len + spec.turns * (spec.user_high + spec.answer_len)
    num_pages = (
        spec.num_requests * -(-longest // PAGE_SIZE) + spec.chats * -(-chat_len // PAGE_SIZE) + 16
    )
    runner = load_runner(checkpoint, num_pages)
    warm_up(make_engine(runner, "v1", num_pages), vocab)

    sweep: dict[str, dict[str, dict[str, float | int | None]]] = {}
    headline: dict[str, PrefixRun] = {}
    for prefix_len in spec.prefix_lens:
        requests = prefix_requests(spec, prefix_len, vocab, ctx.seed)
        ideal = prefix_len + sum(len(r.prompt) - prefix_len for r in requests)
        for cache in (True, False):
            for arrival in ("burst", "sequential"):
                ctx.log(f"shared_prefix: L={prefix_len} cache={'on' if cache else 'off'} {arrival}")
                measured = _run_prefix(runner, num_pages, requests, ideal, cache, arrival)
                key = f"{arrival}_cache_{'on' if cache else 'off'}"
                sweep.setdefault(str(prefix_len), {})[key] = measured.figures()
                if prefix_len == spec.headline_len:
                    headline[key] = measured
    result.figures["prefix_sweep"] = sweep
    result.figures["spec"] = {
        "num_requests": spec.num_requests,
        "suffix_len": [spec.suffix_low, spec.suffix_high],
        "output_len": spec.output_len,
        "headline_prefix_len": spec.headline_len,
        "page_size": PAGE_SIZE,
    }
    _headline_ratios(result, headline)
    _run_chat(ctx, result, spec, runner, num_pages, vocab)
    return result


def _run_prefix(
    runner: ModelRunner,
    num_pages: int,
    requests: list[BenchRequest],
    ideal: int,
    cache: bool,
    arrival: str,
) -> PrefixRun:
    engine = make_engine(runner, "v1", num_pages, enable_prefix_caching=cache)
    if arrival == "burst":
        ttft = list(run_engine(engine, requests, "pagedkv-v1").ttft_s)
    else:
        ttft = [run_engine(engine, [r], "pagedkv-v1").ttft_s[0] for r in requests][1:]
    stats = engine.stats()
    return PrefixRun(stats.prefill_tokens_computed, ideal, stats.hit_tokens, median(ttft))


def _headline_ratios(result: WorkloadResult, runs: dict[str, PrefixRun]) -> None:
    on, off = runs["burst_cache_on"], runs["burst_cache_off"]
    seq_on, seq_off = runs["sequential_cache_on"], runs["sequential_cache_off"]
    result.add_ratio(
        "prefill_saved_vs_ideal",
        ratio(off.prefill - on.prefill, off.prefill - on.ideal),
        "burst arrival: prompt positions saved by prefix caching over those an ideal cache "
        "saves (1.0 = every shared token reused)",
    )
    result.add_ratio(
        "computed_over_ideal",
        ratio(on.prefill, on.ideal),
        "burst arrival: prompt positions computed with caching over the unique tokens (1.0 = "
        "ideal)",
    )
    result.add_target(
        "computed_over_ideal", "<=", 1.05, "shared prefix: prefill tokens within 5% of ideal"
    )
    result.add_ratio(
        "sequential_computed_over_ideal",
        ratio(seq_on.prefill, seq_on.ideal),
        "sequential arrival: prompt positions computed with caching over the unique tokens",
    )
    result.add_ratio(
        "ttft_cache_speedup",
        ratio(seq_off.ttft_p50_s, seq_on.ttft_p50_s),
        "sequential arrival: TTFT p50 with caching off over on (warm shared prefix)",
    )


def _run_chat(
    ctx: BenchContext,
    result: WorkloadResult,
    spec: PrefixSpec,
    runner: ModelRunner,
    num_pages: int,
    vocab: int,
) -> None:
    figures: dict[str, dict[str, float | int | None]] = {}
    computed: dict[bool, int] = {}
    ideal = page_ideal = 0
    for cache in (True, False):
        ctx.log(f"shared_prefix: chat cache={'on' if cache else 'off'}")
        engine = make_engine(runner, "v1", num_pages, enable_prefix_caching=cache)
        rng = random.Random(ctx.seed + 7)
        prompts = [random_tokens(rng, spec.system_len, vocab) for _ in range(spec.chats)]
        ideal = page_ideal = 0
        ttft: list[float] = []
        previous_total = [0] * spec.chats
        for turn in range(spec.turns):
            users = [
                random_tokens(rng, rng.randint(spec.user_low, spec.user_high), vocab)
                for _ in range(spec.chats)
            ]
            prompts = [p + u for p, u in zip(prompts, users, strict=True)]
            for c, user in enumerate(users):
                if turn == 0:
                    ideal += len(prompts[c])
                    page_ideal += len(prompts[c])
                else:
                    ideal += len(user) + 1
                    reusable = (previous_total[c] - 1) // PAGE_SIZE * PAGE_SIZE
                    page_ideal += len(prompts[c]) - reusable
            ids = [engine.add_request(p, greedy_params(spec.answer_len)) for p in prompts]
            answers: dict[str, tuple[int, ...]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        answers[out.request_id] = tuple(out.token_ids)
                        if turn > 0 and out.metrics.ttft is not None:
                            ttft.append(out.metrics.ttft)
            previous_total = [len(p) + spec.answer_len for p in prompts]
            prompts = [p + answers[i] for p, i in zip(prompts, ids, strict=True)]
        computed[cache] = engine.stats().prefill_tokens_computed
        figures[f"cache_{'on' if cache else 'off'}"] = {
            "prefill_tokens_computed": computed[cache],
            "ttft_p50_ms_after_first_turn": rounded(median(ttft) * 1e3, 2),
        }
    figures["ideal_tokens"] = {"unique": ideal, "page_granular": page_ideal}
    result.figures["chat"] = figures
    result.figures["chat_spec"] = {
        "conversations": spec.chats,
        "turns": spec.turns,
        "system_len": spec.system_len,
        "user_len": [spec.user_low, spec.user_high],
        "answer_len": spec.answer_len,
    }
    result.add_ratio(
        "chat_computed_over_ideal",
        ratio(computed[True], ideal),
        "multi-turn chat: prompt positions computed with caching over the unique new tokens",
    )
    result.add_ratio(
        "chat_computed_over_page_ideal",
        ratio(computed[True], page_ideal),
        "multi-turn chat: prompt positions computed over the page-granular ideal (partial "
        "last pages recomputed)",
    )
    result.add_ratio(
        "chat_prefill_saved_vs_ideal",
        ratio(computed[False] - computed[True], computed[False] - ideal),
        "multi-turn chat: prompt positions saved by caching over those an ideal cache saves",
    )
