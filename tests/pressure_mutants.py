"""Deliberately broken backends, each the reference with one bug, behind a factory
``--backend pressure_mutants:<name>`` takes; :data:`PRESSURE_MUTANTS` names the suite tests
that must fail on it (``tests/test_pressure_mutants.py``).

Issue 46's classes 2, 3 and 5: a fork that finds no page queued behind later requests
(ENG-130), an engine that looks a waiting prompt up twice per admission (ENG-027), a store that
pads a decode group with the stale slots its page tables name (PST-013).

And one for each MUST the suite took over from the project's tests. Stores: copying pages of
one layer only (PST-006), attending in a 16-bit query's dtype (PST-018), reading the batch on
the host in attention or attending by the batch prepared last (PST-016). Engines: dividing
logits by a temperature below the epsilon (ENG-046), ignoring the presence penalty or
``min_tokens`` (ENG-048), reporting a request first scheduled when
it arrived (ENG-053), taking a negative seed by its magnitude (ENG-141), seeding unseeded
requests 0 (ENG-140), refusing stop tokens past the vocabulary (ENG-120), taking prompts they
should refuse (ENG-152, ENG-062), reporting empty log-probabilities (ENG-142), prompt
log-probabilities one position late (ENG-049) or with holes (ENG-132), trying stop strings
longest first (ENG-144), holding back text a kept stop string cannot trim (ENG-145). A model
runner sizing its rotary table by its first plan (GLD-014), one serving the unscaled trained
positions (GLD-033), one computing the last rows only (GLD-010, GLD-011), one ignoring
``rope_scaling`` (GLD-032), one returning 16-bit logits (GLD-016); and issue 14's stores
missing a decode row's own position or a chunk's cached context, under a runner's first decode
step (GLD-012) and chunked prefill (GLD-013).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from mutants import MUTANTS
from mutants.backend import ALL_CAPABILITIES, MutantBackend
from mutants.engine import _EngineWrapper
from mutants.store import WrappedMetadata, _OwnAttention, _Wrapper

from pagedkv.backend import ReferenceBackend
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import FLOAT32_TINY, InvalidSamplingParams, SamplingParams
from pagedkv.engine.prompts import PromptType
from pagedkv.interfaces import (
    Allocation,
    AttentionBatch,
    AttentionMetadata,
    KVManager,
    KVManagerConfig,
    PrefixMatch,
    StepRunner,
)
from pagedkv.plan import StepPlan
from pagedkv.testing.delegating_runner import DelegatingRunner

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.generation_config import GenerationDefaults
    from pagedkv.engine.tokenizer import Tokenizer

#: The share of a decode group's longest context every context of the group reaches (the
#: grouping PST-017 asks for).
DECODE_FILL = 0.7

# -- class 2: a fork without a page queued last ----------------------------------------------


def forks_wait_last(engine: Any) -> None:
    """A fork the pool has no page for goes to the back of the waiting queue, behind requests
    that arrived after its request (ENG-130). Wraps the reference scheduler's ``_fork``, whose
    last act puts such forks at the head of ``waiting``."""
    scheduler = engine.scheduler
    original = scheduler._fork

    def fork(parent: Any, tokens: Any, now: float) -> Any:
        children = original(parent, tokens, now)
        for child in children:
            if child in scheduler.waiting:
                scheduler.waiting.remove(child)
                scheduler.waiting.append(child)
        return children

    scheduler._fork = fork


def engine_forks_wait_last() -> MutantBackend:
    return MutantBackend(
        "mutant: a fork without a page waits behind later requests",
        capabilities=ALL_CAPABILITIES | {"fork"},
        adjust=forks_wait_last,
    )


def abort_leaves_waiting_forks(engine: Any) -> None:
    """Aborting a request ends its running sequences but not a fork of it that waits for a
    page (ENG-130): the fork stays queued. Wraps the reference scheduler's ``finish``."""
    scheduler = engine.scheduler
    original = scheduler.finish

    def finish(request: Any, reason: Any) -> None:
        forks = {id(s) for g in engine._requests.values() for s in g.sequences[1:]}
        if reason.value == "abort" and request in scheduler.waiting and id(request) in forks:
            return
        original(request, reason)

    scheduler.finish = finish


def engine_abort_leaves_waiting_forks() -> MutantBackend:
    return MutantBackend(
        "mutant: aborting a request leaves its waiting fork queued",
        capabilities=ALL_CAPABILITIES | {"fork"},
        adjust=abort_leaves_waiting_forks,
    )


def keep_copies_of_ended_forks(engine: Any) -> None:
    """A sequence that ends or is preempted is freed, its source pages parked as ENG-215
    asks, but the copies into its own pages stay for the next plan. Replaces the reference
    scheduler's ``_free``."""
    scheduler = engine.scheduler

    def free(seq_id: int) -> None:
        scheduler._parked.append(seq_id)
        scheduler._free_parked()

    scheduler._free = free


def engine_keeps_copies_of_ended_forks() -> MutantBackend:
    return MutantBackend(
        "mutant: copies into the pages of ended forks are made anyway",
        capabilities=ALL_CAPABILITIES | {"fork"},
        adjust=keep_copies_of_ended_forks,
    )


def free_copy_sources_at_once(engine: Any) -> None:
    """A sequence that ends is freed at once, though a copy not yet made reads its pages
    (ENG-215): another request may write them before a retried step copies them. Replaces
    the reference scheduler's ``_free``, still dropping copies into the freed pages."""
    scheduler = engine.scheduler

    def free(seq_id: int) -> None:
        pages = set(scheduler.kv.page_table(seq_id).pages)
        scheduler._copies = [c for c in scheduler._copies if c.dst not in pages]
        scheduler.kv.free(seq_id)

    scheduler._free = free


def engine_frees_copy_sources_at_once() -> MutantBackend:
    return MutantBackend(
        "mutant: a copy's source pages are freed before the copy is made",
        capabilities=ALL_CAPABILITIES | {"fork"},
        adjust=free_copy_sources_at_once,
    )


# -- class 3: two lookups per admission ------------------------------------------------------


class RematchingKVManager:
    """The engine's view of its manager when it looks a prompt up again right before
    allocating, "to be sure" (ENG-027): every ``allocate`` first calls ``match_prefix`` once
    more and passes that fresh match. Everything else goes through unchanged (``fork``
    included, where the manager forks)."""

    def __init__(self, inner: KVManager) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        again = self.inner.match_prefix(token_ids, cache_salt)
        return self.inner.allocate(seq_id, token_ids, num_new_tokens, cache_salt, match=again)


@dataclass(frozen=True)
class RematchingEngineBackend(ReferenceBackend):
    """The reference whose engine looks every admitted prompt up twice."""

    name: str = "mutant: the engine looks a prompt up again before allocating"

    def create_engine(
        self,
        runner: StepRunner,
        config: EngineConfig,
        *,
        tokenizer: Tokenizer | None = None,
        eos_ids: frozenset[int] = frozenset(),
        generation_defaults: GenerationDefaults | None = None,
        kv_manager: KVManager | None = None,
    ) -> LLMEngine:
        kv = kv_manager
        if kv is None and config.mode == "v1":
            kv = self.create_kv_manager(
                KVManagerConfig(config.num_pages, config.page_size, config.enable_prefix_caching)
            )
        return super().create_engine(
            runner,
            config,
            tokenizer=tokenizer,
            eos_ids=eos_ids,
            generation_defaults=generation_defaults,
            kv_manager=None if kv is None else RematchingKVManager(kv),  # type: ignore[arg-type]
        )


def engine_looks_up_twice() -> RematchingEngineBackend:
    return RematchingEngineBackend()


# -- class 5: decode padding read from stale slots ---------------------------------------------


def decode_widths(q_lens: Sequence[int], contexts: Sequence[int]) -> list[int]:
    """Each sequence's gather width: a decoding sequence's is the longest context of its
    group (decoding sequences sorted by context, cut where a context falls below
    :data:`DECODE_FILL` of the group's longest); a chunk's is its context."""
    widths = list(contexts)
    longest = 0
    for b in sorted((b for b, q in enumerate(q_lens) if q == 1), key=lambda b: -contexts[b]):
        if longest == 0 or contexts[b] < DECODE_FILL * longest:
            longest = contexts[b]
        widths[b] = longest
    return widths


class PadsDecodeWithStaleSlots(_OwnAttention):
    """Decoding sequences of close contexts share a gather padded to the group's longest
    context, as PST-017 asks; the padding reads whatever slots the page table names past the
    context (its last page's stale tail, the table's padding entries) and is hidden by a -inf
    score only, not replaced by a slot known to be finite: a NaN key or an infinite value
    there poisons the row (PST-013)."""

    _widths: Iterator[int] = iter(())

    def attention(
        self, layer: int, query: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert isinstance(metadata, WrappedMetadata), "metadata of another store"
        starts = metadata.batch.query_start.tolist()
        q_lens = [stop - start for start, stop in itertools.pairwise(starts)]
        widths = decode_widths(q_lens, metadata.batch.context_lens.tolist())
        self._widths = iter(widths)
        return super().attention(layer, query, metadata, scale)

    def visible(self, q_len: int, ctx: int, width: int) -> tuple[int, torch.Tensor]:
        group = next(self._widths)
        if q_len > 1 or group == ctx:
            return super().visible(q_len, ctx, width)
        return group, (torch.arange(group) < ctx)[None, :]


def store_pads_decode_with_stale_slots() -> MutantBackend:
    return MutantBackend(
        "mutant: decode padding reads stale slots",
        capabilities=ALL_CAPABILITIES,
        store=PadsDecodeWithStaleSlots,
    )


# -- MUSTs the suite took over from the project's tests -----------------------------------------


class CopiesLayerZeroOnly(_Wrapper):
    """``copy_pages`` copies the K/V pages of layer 0 only, as a store written for one pool
    would (PST-006); other layers keep what the target pages held."""

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        size = self.config.page_size
        offsets = torch.arange(size)
        from_slots = (src[:, None] * size + offsets).reshape(-1)
        to_slots = (dst[:, None] * size + offsets).reshape(-1)
        key, value = self.inner.read(0, from_slots)
        self.inner.write(0, to_slots, key, value)


def store_copies_layer_zero_only() -> MutantBackend:
    return MutantBackend(
        "mutant: copy_pages copies layer 0 only",
        capabilities=ALL_CAPABILITIES,
        store=CopiesLayerZeroOnly,
    )


class ScheduledOnArrival(_EngineWrapper):
    """Reports a request first scheduled when it arrived, queued or not (ENG-053)."""

    def output(self, output: RequestOutput) -> RequestOutput:
        metrics = dataclasses.replace(
            output.metrics, first_scheduled_time=output.metrics.arrival_time
        )
        return dataclasses.replace(output, metrics=metrics)


def engine_scheduled_on_arrival() -> MutantBackend:
    return MutantBackend(
        "mutant: first scheduled when it arrived",
        capabilities=ALL_CAPABILITIES,
        engine=ScheduledOnArrival,
    )


class SeedByMagnitude(_EngineWrapper):
    """Takes a negative seed by its magnitude (``abs``) instead of modulo 2^64 (ENG-141)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None or params.seed is None:
            return params
        return dataclasses.replace(params, seed=abs(params.seed))


def engine_seed_by_magnitude() -> MutantBackend:
    return MutantBackend(
        "mutant: a negative seed taken by its magnitude",
        capabilities=ALL_CAPABILITIES,
        engine=SeedByMagnitude,
    )


class UnseededAsSeedZero(_EngineWrapper):
    """Samples a request without a seed as one seeded 0, a fixed default seed (ENG-140)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None or params.seed is not None:
            return params
        return dataclasses.replace(params, seed=0)


def engine_unseeded_as_seed_zero() -> MutantBackend:
    return MutantBackend(
        "mutant: unseeded requests seeded 0",
        capabilities=ALL_CAPABILITIES,
        engine=UnseededAsSeedZero,
    )


def tiny_temperatures_divided(engine: Any) -> None:
    """Divides a row's logits by its temperature before the sampler decides it is greedy, so a
    temperature below the epsilon overflows them to infinities whose argmax is the first one
    (ENG-046). Wraps the reference engine's ``_sample_rows``."""
    original = engine._sample_rows

    def sample_rows(logits: torch.Tensor, rows: Any) -> Any:
        tiny = [i for i, row in enumerate(rows) if 0 < row.params.temperature < 1e-5]
        if tiny:
            logits = logits.clone()
            for i in tiny:
                logits[i] = logits[i] / rows[i].params.temperature
        return original(logits, rows)

    engine._sample_rows = sample_rows


def engine_tiny_temperatures_divided() -> MutantBackend:
    return MutantBackend(
        "mutant: tiny temperatures divide the logits",
        capabilities=ALL_CAPABILITIES,
        adjust=tiny_temperatures_divided,
    )


class TinyTopPUnfiltered(_EngineWrapper):
    """Reads a ``top_p`` below float32's smallest normal number, 0 once in float32, as no
    filter at all, instead of keeping the top token (ENG-177, ENG-178)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None or not 0 < params.top_p < FLOAT32_TINY:
            return params
        return dataclasses.replace(params, top_p=1.0)


def engine_tiny_top_p_unfiltered() -> MutantBackend:
    return MutantBackend(
        "mutant: a top_p that underflows float32 filters nothing",
        capabilities=ALL_CAPABILITIES,
        engine=TinyTopPUnfiltered,
    )


class PresencePenaltyIgnored(_EngineWrapper):
    """Applies every sampling control but ``presence_penalty`` (ENG-048)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None:
            return params
        return dataclasses.replace(params, presence_penalty=0.0)


def engine_presence_penalty_ignored() -> MutantBackend:
    return MutantBackend(
        "mutant: presence penalty ignored",
        capabilities=ALL_CAPABILITIES,
        engine=PresencePenaltyIgnored,
    )


class MinTokensIgnored(_EngineWrapper):
    """Applies every sampling control but ``min_tokens``: EOS and stop tokens end a request
    before it has that many tokens (ENG-048)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None:
            return params
        return dataclasses.replace(params, min_tokens=0)


def engine_min_tokens_ignored() -> MutantBackend:
    return MutantBackend(
        "mutant: min_tokens ignored",
        capabilities=ALL_CAPABILITIES,
        engine=MinTokensIgnored,
    )


class RefusesStopTokensPastVocabulary(_EngineWrapper):
    """Refuses a stop token id the vocabulary does not hold, as a validation written against
    the model's vocabulary would (ENG-120)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        vocab = self.inner.runner.vocab_size  # type: ignore[attr-defined]
        if params is not None and any(t >= vocab for t in params.stop_token_ids):
            raise InvalidSamplingParams(f"stop_token_ids must be below the vocabulary ({vocab})")
        return params


def engine_refuses_stop_tokens_past_vocabulary() -> MutantBackend:
    return MutantBackend(
        "mutant: stop token ids past the vocabulary refused",
        capabilities=ALL_CAPABILITIES,
        engine=RefusesStopTokensPastVocabulary,
    )


class TokenIdsFromAnyIterable(_EngineWrapper):
    """Takes bytes and sets of ints as token ids, bare or in a prompt dict, by listing them
    ("any iterable of ints"), where ENG-152 refuses them."""

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        loose: Any = prompt
        if isinstance(loose, bytes | set):
            loose = list(loose)
        elif isinstance(loose, dict) and isinstance(loose.get("prompt_token_ids"), bytes | set):
            loose = {**loose, "prompt_token_ids": list(loose["prompt_token_ids"])}
        return super().add_request(loose, params, request_id=request_id, cache_salt=cache_salt)


def engine_token_ids_from_any_iterable() -> MutantBackend:
    return MutantBackend(
        "mutant: token ids from bytes and sets",
        capabilities=ALL_CAPABILITIES,
        engine=TokenIdsFromAnyIterable,
    )


class PromptDictKeysIgnored(_EngineWrapper):
    """Drops the keys of a prompt dict it does not know instead of refusing them (ENG-062)."""

    KNOWN = ("prompt", "prompt_token_ids", "cache_salt")

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        loose: Any = prompt
        if isinstance(loose, dict):
            loose = {k: v for k, v in loose.items() if k in self.KNOWN}
        return super().add_request(loose, params, request_id=request_id, cache_salt=cache_salt)


def engine_prompt_dict_keys_ignored() -> MutantBackend:
    return MutantBackend(
        "mutant: unknown prompt dict keys ignored",
        capabilities=ALL_CAPABILITIES,
        engine=PromptDictKeysIgnored,
    )


class LogprobsAlwaysAList(_EngineWrapper):
    """Reports an empty list of log-probabilities for a completion that asked for none, where
    ENG-142 asks for ``None``."""

    def output(self, output: RequestOutput) -> RequestOutput:
        completions = tuple(
            c if c.logprobs is not None else dataclasses.replace(c, logprobs=())
            for c in output.outputs
        )
        return dataclasses.replace(output, outputs=completions)


def engine_logprobs_always_a_list() -> MutantBackend:
    return MutantBackend(
        "mutant: logprobs an empty list when none were asked for",
        capabilities=ALL_CAPABILITIES,
        engine=LogprobsAlwaysAList,
    )


class PartialPromptLogprobs(_EngineWrapper):
    """A request aborted before its prompt was computed reports prompt log-probabilities with
    a hole for every position instead of none (ENG-132)."""

    def abort(self, request_id: str) -> RequestOutput | None:
        out = self.inner.abort(request_id)
        if out is None or out.prompt_logprobs is not None:
            return out
        return dataclasses.replace(out, prompt_logprobs=(None,) * len(out.prompt_token_ids))


def engine_partial_prompt_logprobs() -> MutantBackend:
    return MutantBackend(
        "mutant: prompt log-probabilities with holes",
        capabilities=ALL_CAPABILITIES,
        engine=PartialPromptLogprobs,
    )


class StopStringsLongestFirst(_EngineWrapper):
    """Tries stop strings longest first, as a greedy longest-match would, so of two starting
    together the longer wins whatever their order (ENG-144)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None or not params.stop:
            return params
        return dataclasses.replace(params, stop=tuple(sorted(params.stop, key=len, reverse=True)))


def engine_stop_strings_longest_first() -> MutantBackend:
    return MutantBackend(
        "mutant: stop strings longest first",
        capabilities=ALL_CAPABILITIES,
        engine=StopStringsLongestFirst,
    )


class HoldsBackKeptStopStrings(_EngineWrapper):
    """Holds back the newest token's text of an unfinished completion even when stop strings
    stay in the text (ENG-145): as if it could still be trimmed."""

    def output(self, output: RequestOutput) -> RequestOutput:
        if output.finished:
            return output
        completions = tuple(
            dataclasses.replace(c, text=c.text[: len(c.text) - len(c.new_text)])
            for c in output.outputs
        )
        return dataclasses.replace(output, outputs=completions)


def engine_holds_back_kept_stop_strings() -> MutantBackend:
    return MutantBackend(
        "mutant: text held back though stop strings stay in it",
        capabilities=ALL_CAPABILITIES,
        engine=HoldsBackKeptStopStrings,
    )


class PromptLogprobsOneLate(_EngineWrapper):
    """Reports each prompt position's log-probability one position late, as an engine reading
    the row of a position's own logits for its token would misplace them (ENG-049)."""

    def output(self, output: RequestOutput) -> RequestOutput:
        entries = output.prompt_logprobs
        if entries is None or len(entries) < 2:
            return output
        return dataclasses.replace(output, prompt_logprobs=(None, *entries[:-1]))


def engine_prompt_logprobs_one_late() -> MutantBackend:
    return MutantBackend(
        "mutant: prompt log-probabilities one position late",
        capabilities=ALL_CAPABILITIES,
        engine=PromptLogprobsOneLate,
    )


class AttendsInTheQueryDtype(_OwnAttention):
    """Attention over ``read`` computed in the query's dtype: a 16-bit decode rounds at every
    product and in the softmax instead of once (PST-018). Right in float32."""


class ReadsTheBatchOnTheHost(_OwnAttention):
    """Attention over ``read`` in float32, sequence by sequence, reading the batch's offsets
    and context lengths on the host in every layer's call (PST-016): right values, a
    device-to-host synchronisation per layer."""

    def attention(
        self, layer: int, query: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return super().attention(layer, query.float(), metadata, scale).to(query.dtype)


class LastPreparedWins(_Wrapper):
    """Keeps the layout of the batch it prepared last and attends by it, whatever metadata a
    call is given (PST-016: no per-batch state between calls)."""

    _last: AttentionMetadata | None = None

    def prepare(self, batch: AttentionBatch) -> AttentionMetadata:
        self._last = super().prepare(batch)
        return self._last

    def attention(
        self, layer: int, query: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return super().attention(layer, query, self._last or metadata, scale)


def store_attends_in_the_query_dtype() -> MutantBackend:
    return MutantBackend(
        "mutant: attention in the query's dtype",
        capabilities=ALL_CAPABILITIES,
        store=AttendsInTheQueryDtype,
    )


def store_reads_the_batch_on_the_host() -> MutantBackend:
    return MutantBackend(
        "mutant: batch read on the host in attention",
        capabilities=ALL_CAPABILITIES,
        store=ReadsTheBatchOnTheHost,
    )


def store_last_prepared_wins() -> MutantBackend:
    return MutantBackend(
        "mutant: attends by the batch prepared last",
        capabilities=ALL_CAPABILITIES,
        store=LastPreparedWins,
    )


#: Wraps a reference model runner in a broken one, given the runner, the checkpoint's folder
#: and the dtype name it was loaded in.
RunnerWrap = Callable[[StepRunner, str, str], StepRunner]


@dataclass(frozen=True)
class WrappedRunnerBackend(ReferenceBackend):
    """The reference whose model runners are wrapped by ``wrap``: one runner-level mistake."""

    name: str = "mutant: a wrapped model runner"
    wrap: RunnerWrap = dataclasses.field(kw_only=True, repr=False)

    def create_model_runner(
        self,
        model_dir: str,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> StepRunner:
        inner = super().create_model_runner(
            model_dir, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )
        return self.wrap(inner, model_dir, dtype)


class RotaryTableSizedByFirstPlan(DelegatingRunner):
    """Sizes its rotary table by the positions of the first plan it runs and clamps later
    positions to it, as a lazily built cache never grown would (GLD-014): a plan's logits then
    depend on which plan came first."""

    _limit: int | None = None

    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self._limit is None:
            self._limit = int(plan.positions.max()) + 1
        positions = plan.positions.clamp(max=self._limit - 1)
        return self.inner.execute(dataclasses.replace(plan, positions=positions))


def runner_rotary_table_sized_by_first_plan() -> WrappedRunnerBackend:
    return WrappedRunnerBackend(
        name="mutant: rotary table sized by the first plan",
        wrap=lambda runner, _, __: RotaryTableSizedByFirstPlan(runner),
    )


class ServesTheTrainedPositions(DelegatingRunner):
    """Reports ``max_position_embeddings`` as the context it serves, whatever the RoPE scaling
    (GLD-033)."""

    def __init__(self, inner: StepRunner, trained: int) -> None:
        super().__init__(inner)
        self.trained = trained

    @property
    def max_positions(self) -> int | None:
        return self.trained


def _trained_positions(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return int(config["max_position_embeddings"])


def runner_serves_the_trained_positions() -> WrappedRunnerBackend:
    return WrappedRunnerBackend(
        name="mutant: served context ignores the RoPE scaling",
        wrap=lambda runner, model_dir, _: ServesTheTrainedPositions(
            runner, _trained_positions(model_dir)
        ),
    )


class LastRowsOnly(DelegatingRunner):
    """Computes the logits of each sequence's last row only, whatever rows the plan asks for
    (GLD-010, GLD-011): right for generation, wrong for every position's logits."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        last = plan.attention.query_start[1:] - 1
        return self.inner.execute(dataclasses.replace(plan, logits_indices=last))


def runner_last_rows_only() -> WrappedRunnerBackend:
    return WrappedRunnerBackend(
        name="mutant: logits of the last rows only",
        wrap=lambda runner, _, __: LastRowsOnly(runner),
    )


def store_decode_misses_newest() -> MutantBackend:
    """The store mutant of issue 14 whose decode row misses its own position, here under the
    runner's first decode step (GLD-012)."""
    return MUTANTS["store_decode_misses_newest"].build()


def store_chunk_ignores_cached_context() -> MutantBackend:
    """Issue 14's store whose multi-row chunk attends only over its own rows, here under a
    runner's chunked prefill (GLD-013)."""
    return MUTANTS["store_chunk_ignores_cached_context"].build()


@dataclass(frozen=True)
class RopeScalingIgnoredBackend(ReferenceBackend):
    """The reference whose model runners read a checkpoint without its ``rope_scaling``, as a
    loader that knows only the plain RoPE would (GLD-032)."""

    name: str = "mutant: rope_scaling ignored"

    def create_model_runner(
        self,
        model_dir: str,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> StepRunner:
        plain = Path(tempfile.mkdtemp(prefix="rope-ignored-")) / "model"
        shutil.copytree(model_dir, plain)
        config = json.loads((plain / "config.json").read_text(encoding="utf-8"))
        config.pop("rope_scaling", None)
        params = config.get("rope_parameters")
        if isinstance(params, dict):
            theta = params.get("rope_theta", config.get("rope_theta"))
            config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        (plain / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return super().create_model_runner(
            str(plain), num_pages=num_pages, page_size=page_size, dtype=dtype, device=device
        )


def runner_rope_scaling_ignored() -> RopeScalingIgnoredBackend:
    return RopeScalingIgnoredBackend()


class LogitsInTheModelDtype(DelegatingRunner):
    """Returns a 16-bit model's logits in its own dtype instead of float32 (GLD-016)."""

    def __init__(self, inner: StepRunner, dtype: torch.dtype) -> None:
        super().__init__(inner)
        self.dtype = dtype

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self.inner.execute(plan).to(self.dtype)


def runner_logits_in_the_model_dtype() -> WrappedRunnerBackend:
    return WrappedRunnerBackend(
        name="mutant: logits in the model's dtype",
        wrap=lambda runner, _, dtype: LogitsInTheModelDtype(runner, getattr(torch, dtype)),
    )


# -- what catches them -------------------------------------------------------------------------


@dataclass(frozen=True)
class PressureMutant:
    """A broken backend and the suite tests (ids under ``pagedkv_conformance``) that must
    fail on it and pass on the reference."""

    build: Callable[[], Any] = dataclasses.field(repr=False)
    catches: tuple[str, ...]


STORE = "test_paged_store::TestPagedStore::"
LOGITS = "test_model_logits::TestModelLogits::"
#: A dense and a Qwen3-MoE preset of the logits suite (GLD-041 holds MoE to the same checks).
CHECKED_MODELS = ("tied-gqa2", "moe-top2-norm")

PRESSURE_MUTANTS: dict[str, PressureMutant] = {
    "engine_forks_wait_last": PressureMutant(
        engine_forks_wait_last,
        (
            "test_engine_pressure::TestEnginePressure::"
            "test_a_fork_without_a_page_waits_ahead_of_later_requests",
        ),
    ),
    "engine_abort_leaves_waiting_forks": PressureMutant(
        engine_abort_leaves_waiting_forks,
        (
            "test_engine_pressure::TestEnginePressure::"
            "test_aborting_a_request_ends_its_waiting_fork",
        ),
    ),
    "engine_keeps_copies_of_ended_forks": PressureMutant(
        engine_keeps_copies_of_ended_forks,
        (
            "test_engine_pressure::TestEnginePressure::"
            "test_no_copy_is_made_for_forks_aborted_before_it",
        ),
    ),
    "engine_frees_copy_sources_at_once": PressureMutant(
        engine_frees_copy_sources_at_once,
        (
            "test_engine_pressure::TestEnginePressure::"
            "test_a_copy_source_stays_held_until_the_copy_is_made",
        ),
    ),
    "engine_looks_up_twice": PressureMutant(
        engine_looks_up_twice,
        (
            "test_engine_admission::TestEngineAdmission::"
            "test_each_admission_looks_up_once_and_allocates_from_that_match",
        ),
    ),
    "store_copies_layer_zero_only": PressureMutant(
        store_copies_layer_zero_only,
        ("test_paged_store::TestPagedStore::test_copy_pages_copies_every_layer_and_nothing_else",),
    ),
    "engine_scheduled_on_arrival": PressureMutant(
        engine_scheduled_on_arrival,
        tuple(
            "test_engine_admission::TestEngineAdmission::"
            f"test_first_scheduled_time_is_when_a_request_left_the_queue[{mode}]"
            for mode in ("v1", "v0")
        ),
    ),
    "engine_seed_by_magnitude": PressureMutant(
        engine_seed_by_magnitude,
        (
            "test_engine_param_edges::TestEngineParamsEdges::"
            "test_seeds_equal_modulo_two_to_the_64_sample_alike",
        ),
    ),
    "engine_unseeded_as_seed_zero": PressureMutant(
        engine_unseeded_as_seed_zero,
        (
            "test_engine_param_edges::TestEngineParamsEdges::"
            "test_unseeded_requests_sample_apart_and_leave_the_global_generator",
        ),
    ),
    "engine_tiny_temperatures_divided": PressureMutant(
        engine_tiny_temperatures_divided,
        tuple(
            "test_engine_param_edges::TestEngineParamsEdges::"
            f"test_a_temperature_below_the_epsilon_is_greedy[{t}]"
            for t in ("1e-40", "5e-324")
        ),
    ),
    "engine_tiny_top_p_unfiltered": PressureMutant(
        engine_tiny_top_p_unfiltered,
        (
            "test_engine_param_edges::TestEngineParamsEdges::"
            "test_every_float_edge_is_refused_or_runs_to_its_tokens[top_p]",
        ),
    ),
    "engine_presence_penalty_ignored": PressureMutant(
        engine_presence_penalty_ignored,
        (
            "test_engine_controls::TestEngineControls::test_the_engine_picks_the_reference_argmax[2]",
        ),
    ),
    "engine_min_tokens_ignored": PressureMutant(
        engine_min_tokens_ignored,
        (
            "test_engine_controls::TestEngineControls::test_the_engine_picks_the_reference_argmax[2]",
        ),
    ),
    "engine_refuses_stop_tokens_past_vocabulary": PressureMutant(
        engine_refuses_stop_tokens_past_vocabulary,
        (
            "test_engine_param_edges::TestEngineParamsEdges::"
            "test_stop_tokens_outside_the_vocabulary_are_accepted_and_end_nothing",
        ),
    ),
    "engine_token_ids_from_any_iterable": PressureMutant(
        engine_token_ids_from_any_iterable,
        ("test_engine_prompts::TestEnginePrompts::test_token_ids_are_a_list_or_tuple_of_ints",),
    ),
    "engine_prompt_dict_keys_ignored": PressureMutant(
        engine_prompt_dict_keys_ignored,
        (
            "test_engine_prompts::TestEnginePrompts::"
            "test_a_prompt_dict_has_one_prompt_and_maybe_a_salt",
        ),
    ),
    "engine_logprobs_always_a_list": PressureMutant(
        engine_logprobs_always_a_list,
        ("test_engine_outputs::TestEngineOutputs::test_completions_of_several_sequences",),
    ),
    "engine_partial_prompt_logprobs": PressureMutant(
        engine_partial_prompt_logprobs,
        (
            "test_engine_outputs::TestEngineOutputs::"
            "test_a_request_aborted_mid_prefill_reports_no_prompt_logprobs",
        ),
    ),
    "engine_stop_strings_longest_first": PressureMutant(
        engine_stop_strings_longest_first,
        (
            "test_engine_stop_strings::TestEngineStopStrings::"
            "test_of_stop_strings_completed_together_the_first_starting_counts[same-start-listed-second]",
        ),
    ),
    "engine_holds_back_kept_stop_strings": PressureMutant(
        engine_holds_back_kept_stop_strings,
        (
            "test_engine_stop_strings::TestEngineStopStrings::"
            "test_nothing_is_held_back_when_stop_strings_stay_in_the_text",
        ),
    ),
    "engine_prompt_logprobs_one_late": PressureMutant(
        engine_prompt_logprobs_one_late,
        tuple(
            "test_engine_outputs::TestEngineOutputs::"
            f"test_each_prompt_token_gets_its_log_probability[{budget}]"
            for budget in (256, 4, 3)
        ),
    ),
    "store_attends_in_the_query_dtype": PressureMutant(
        store_attends_in_the_query_dtype,
        tuple(
            f"{STORE}test_16_bit_decode_attention_is_float32_rounded_once[{dtype}]"
            for dtype in ("bfloat16", "float16")
        ),
    ),
    "store_reads_the_batch_on_the_host": PressureMutant(
        store_reads_the_batch_on_the_host,
        (STORE + "test_write_and_attention_never_read_a_tensor_on_the_host",),
    ),
    "store_last_prepared_wins": PressureMutant(
        store_last_prepared_wins,
        (STORE + "test_metadata_of_several_batches_is_used_in_any_order",),
    ),
    "runner_rotary_table_sized_by_first_plan": PressureMutant(
        runner_rotary_table_sized_by_first_plan,
        ("test_model_runner::TestModelRunner::test_logits_depend_only_on_the_plan",),
    ),
    "runner_serves_the_trained_positions": PressureMutant(
        runner_serves_the_trained_positions,
        tuple(
            f"test_model_runner::TestModelRunner::test_the_served_context_follows_the_scaling[{p}]"
            for p in ("yarn-128", "linear-128")
        ),
    ),
    "runner_last_rows_only": PressureMutant(
        runner_last_rows_only,
        tuple(
            f"{LOGITS}{test}"
            for preset in CHECKED_MODELS
            for test in (
                f"test_a_v0_plan_gives_every_positions_logits[{preset}]",
                *(f"test_a_v1_prefill_and_the_first_decode_step[{p}-{preset}]" for p in (1, 5, 16)),
            )
        ),
    ),
    "store_decode_misses_newest": PressureMutant(
        store_decode_misses_newest,
        tuple(
            f"{LOGITS}test_a_v1_prefill_and_the_first_decode_step[{p}-{preset}]"
            for preset in CHECKED_MODELS
            for p in (1, 5, 16)
        ),
    ),
    "store_chunk_ignores_cached_context": PressureMutant(
        store_chunk_ignores_cached_context,
        tuple(
            f"{LOGITS}test_chunks_starting_mid_page_beside_decodes[{preset}]"
            for preset in CHECKED_MODELS
        ),
    ),
    "runner_rope_scaling_ignored": PressureMutant(
        runner_rope_scaling_ignored,
        tuple(
            f"{LOGITS}test_scaled_rope_logits_past_the_original_context[{preset}]"
            for preset in ("linear", "llama3", "yarn")
        ),
    ),
    "runner_logits_in_the_model_dtype": PressureMutant(
        runner_logits_in_the_model_dtype,
        tuple(
            f"{LOGITS}test_16_bit_checkpoints_run_to_float32_logits[{dtype}]"
            for dtype in ("bfloat16", "float16")
        ),
    ),
    "store_pads_decode_with_stale_slots": PressureMutant(
        store_pads_decode_with_stale_slots,
        ("test_paged_store::TestPagedStore::test_poisoned_padding_of_a_decode_group_never_leaks",),
    ),
}
