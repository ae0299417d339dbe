"""Deliberately broken engines, one slip each in the sampling controls (ENG-048) or in a prompt
dict's salt (ENG-062), to prove ``pagedkv_conformance.test_engine_sampling`` and
``pagedkv_conformance.test_engine_salt`` can fail.

Four slips sit at the Engine Protocol, as rewritten requests: a presence penalty counted per
occurrence is a frequency penalty, a frequency penalty counted once per token is a presence
penalty, ``min_tokens`` one short is ``min_tokens - 1``, and a dropped salt is a prompt dict
without its ``cache_salt``. Six cannot: a bias put in place of the logit, a repetition
penalty blind to the prompt, presence and frequency penalties counting the prompt, controls
applied to greedy rows only, an output folded into the prompt when its request is preempted and
the samples of one request sharing one history live in the reference's sampler (and
scheduler), whose ``apply_logit_bias``, ``apply_penalties`` or ``processed_logits`` they
replace for the duration of the engine's own sampling calls, so no other engine of the process
is touched.
``tests/test_sampling_mutants.py`` runs the suite tests each one names (``--backend
sampling_mutants:<name>``) and expects each to fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from mutants.backend import ALL_CAPABILITIES, MutantBackend
from mutants.engine import _EngineWrapper

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import PromptType
from pagedkv.engine.sampler import SampleRow

SAMPLING = "test_engine_sampling::TestEngineSampling::"
SALT = "test_engine_salt::TestEngineSalt::"
#: The mixed batch, in both modes.
BATCH = tuple(SAMPLING + f"test_controls_together_in_one_batch[{m}]" for m in ("v1", "v0"))


# -- requests rewritten at the Engine Protocol -------------------------------------------------


class PresencePerOccurrence(_EngineWrapper):
    """The presence penalty is subtracted once per occurrence, as the frequency penalty is."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None or not params.presence_penalty:
            return params
        return dataclasses.replace(
            params,
            presence_penalty=0.0,
            frequency_penalty=params.frequency_penalty + params.presence_penalty,
        )


class FrequencyPerPresence(_EngineWrapper):
    """The frequency penalty is subtracted once per token the output holds, as the presence
    penalty is."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None or not params.frequency_penalty:
            return params
        return dataclasses.replace(
            params,
            frequency_penalty=0.0,
            presence_penalty=params.presence_penalty + params.frequency_penalty,
        )


class MinTokensOneShort(_EngineWrapper):
    """EOS and the stop tokens are masked while the output is shorter than ``min_tokens - 1``."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None or params.min_tokens == 0:
            return params
        return dataclasses.replace(params, min_tokens=params.min_tokens - 1)


def _unsalted(prompt: PromptType) -> PromptType:
    """``prompt`` without a dict's ``cache_salt``."""
    if isinstance(prompt, Mapping):
        return {k: v for k, v in prompt.items() if k != "cache_salt"}  # type: ignore[return-value]
    return prompt


class DictSaltDropped(_EngineWrapper):
    """A prompt dict's ``cache_salt`` is dropped: the request shares the unsalted cache."""

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        return self.inner.add_request(
            _unsalted(prompt), params, request_id=request_id, cache_salt=cache_salt
        )

    def stream(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Generator[RequestOutput, None, None]:
        yield from self.inner.stream(_unsalted(prompt), params, cache_salt=cache_salt)


# -- the reference sampler with one step replaced ------------------------------------------------


def _bias_replaces(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """``logit_bias`` written in place of its token's logit."""
    for i, row in enumerate(rows):
        for token, bias in row.params.bias:
            logits[i, token] = bias


def _penalties_on_output_only(
    original: Callable[[torch.Tensor, Sequence[SampleRow]], None],
) -> Callable[[torch.Tensor, Sequence[SampleRow]], None]:
    """The reference's penalties, told every prompt is empty: the repetition penalty sees only
    the output."""

    def apply(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        original(logits, [dataclasses.replace(r, prompt_token_ids=()) for r in rows])

    return apply


def _penalties_counting_the_prompt(
    original: Callable[[torch.Tensor, Sequence[SampleRow]], None],
) -> Callable[[torch.Tensor, Sequence[SampleRow]], None]:
    """The reference's penalties, told every output begins with its prompt: the presence and
    frequency penalties count prompt tokens too (the repetition penalty's set is unchanged)."""

    def apply(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        original(
            logits,
            [
                dataclasses.replace(r, output_token_ids=[*r.prompt_token_ids, *r.output_token_ids])
                for r in rows
            ],
        )

    return apply


def _controls_on_greedy_rows_only(
    original: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """The reference's processed logits for greedy rows; the rows that draw keep the model's
    logits, as if the controls were a step of the greedy path."""

    def processed(
        logits: torch.Tensor, rows: Sequence[SampleRow], stop_ids: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        out = original(logits, rows, stop_ids)
        for i, row in enumerate(rows):
            if not row.params.greedy:
                out[i] = logits[i].float()
        return out

    return processed


def _siblings_share_the_first_output(
    original: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """The reference's processed logits, with every sample of a parallel request (the rows
    sharing one params object and prompt) penalised by the first sample's output: a history
    kept per request instead of per sequence."""

    def processed(
        logits: torch.Tensor, rows: Sequence[SampleRow], stop_ids: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        first: dict[tuple[int, tuple[int, ...]], Sequence[int]] = {}
        shared = []
        for row in rows:
            key = (id(row.params), tuple(row.prompt_token_ids))
            output = first.setdefault(key, row.output_token_ids)
            shared.append(dataclasses.replace(row, output_token_ids=output))
        return original(logits, shared, stop_ids)

    return processed


def _patch_sampler(engine: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Make this engine's sampling use ``make(original)`` for ``pagedkv.engine.sampler.<name>``
    (which ``processed_logits`` calls), swapped in for each ``_sample_rows`` call only."""
    import pagedkv.engine.sampler as sampler

    original_rows = engine._sample_rows

    def sample_rows(logits: torch.Tensor, rows: Any) -> Any:
        saved = getattr(sampler, name)
        setattr(sampler, name, make(saved))
        try:
            return original_rows(logits, rows)
        finally:
            setattr(sampler, name, saved)

    engine._sample_rows = sample_rows


def _adjust_bias_replaces(engine: Any) -> None:
    _patch_sampler(engine, "apply_logit_bias", lambda _original: _bias_replaces)


def _adjust_output_only_repetition(engine: Any) -> None:
    _patch_sampler(engine, "apply_penalties", _penalties_on_output_only)


def _adjust_prompt_counted(engine: Any) -> None:
    _patch_sampler(engine, "apply_penalties", _penalties_counting_the_prompt)


def _adjust_greedy_only(engine: Any) -> None:
    _patch_sampler(engine, "processed_logits", _controls_on_greedy_rows_only)


def _adjust_output_folded_on_preemption(engine: Any) -> None:
    """(Reads the reference's paged scheduler.) A preempted request is recomputed as if the
    tokens it had generated were part of its prompt: the sampler's rows of that request see
    them as prompt, so the presence and frequency penalties and ``min_tokens`` count only what
    it generates after its last preemption."""
    scheduler = engine.scheduler
    if not hasattr(scheduler, "_preempt"):
        return  # a v0 (recompute) engine never preempts
    # The id of a request's prompt tuple (which its sampler rows carry) -> the tokens folded.
    folded: dict[int, int] = {}
    original_preempt = scheduler._preempt

    def preempt(request: Any) -> None:
        folded[id(request.prompt_token_ids)] = request.num_output_tokens
        original_preempt(request)

    scheduler._preempt = preempt

    def rows_folded(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def processed(
            logits: torch.Tensor, rows: Sequence[SampleRow], stop_ids: frozenset[int] = frozenset()
        ) -> torch.Tensor:
            seen = []
            for row in rows:
                cut = folded.get(id(row.prompt_token_ids), 0)
                prompt = [*row.prompt_token_ids, *row.output_token_ids[:cut]]
                seen.append(
                    dataclasses.replace(
                        row, prompt_token_ids=prompt, output_token_ids=row.output_token_ids[cut:]
                    )
                )
            return original(logits, seen, stop_ids)

        return processed

    _patch_sampler(engine, "processed_logits", rows_folded)


def _adjust_shared_history(engine: Any) -> None:
    _patch_sampler(engine, "processed_logits", _siblings_share_the_first_output)


# -- the catalogue ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingMutant:
    """One broken engine and the suite tests that must each fail on it (and pass on the
    reference)."""

    catches: tuple[str, ...]
    build: Callable[[], MutantBackend] = field(repr=False)


def _mutant(name: str, catches: tuple[str, ...], **part: Any) -> SamplingMutant:
    return SamplingMutant(
        catches,
        lambda: MutantBackend(f"mutant: {name}", capabilities=ALL_CAPABILITIES, **part),
    )


#: Every mutant, by the name ``--backend sampling_mutants:<name>`` takes.
SAMPLING_MUTANTS: dict[str, SamplingMutant] = {
    "bias_replaces_the_logit": _mutant(
        "logit_bias replaces the logit",
        (
            SAMPLING + "test_logit_bias_adds_to_the_logit[a]",
            SAMPLING + "test_logit_bias_adds_to_the_logit[b]",
            *BATCH,
        ),
        adjust=_adjust_bias_replaces,
    ),
    "presence_per_occurrence": _mutant(
        "presence_penalty per occurrence",
        (
            SAMPLING + "test_presence_penalty_counts_each_output_token_once[attracts]",
            SAMPLING + "test_presence_penalty_counts_each_output_token_once[repels]",
            *BATCH,
        ),
        engine=PresencePerOccurrence,
    ),
    "frequency_per_presence": _mutant(
        "frequency_penalty once per token",
        (
            SAMPLING + "test_frequency_penalty_counts_every_occurrence[attracts]",
            SAMPLING + "test_frequency_penalty_counts_every_occurrence[repels]",
            *BATCH,
        ),
        engine=FrequencyPerPresence,
    ),
    "repetition_penalty_on_output_only": _mutant(
        "repetition_penalty blind to the prompt",
        (
            SAMPLING + "test_repetition_penalty_covers_the_prompt_and_the_output[repels]",
            SAMPLING + "test_repetition_penalty_covers_the_prompt_and_the_output[attracts]",
            *BATCH,
        ),
        adjust=_adjust_output_only_repetition,
    ),
    "penalties_count_the_prompt": _mutant(
        "presence and frequency penalties count the prompt",
        (
            SAMPLING + "test_presence_penalty_counts_each_output_token_once[attracts]",
            SAMPLING + "test_presence_penalty_counts_each_output_token_once[repels]",
            SAMPLING + "test_frequency_penalty_counts_every_occurrence[attracts]",
            SAMPLING + "test_frequency_penalty_counts_every_occurrence[repels]",
            *BATCH,
        ),
        adjust=_adjust_prompt_counted,
    ),
    "controls_on_greedy_rows_only": _mutant(
        "sampling controls applied to greedy rows only",
        (SAMPLING + "test_controls_apply_when_sampling",),
        adjust=_adjust_greedy_only,
    ),
    "output_folded_on_preemption": _mutant(
        "the output folded into the prompt on preemption",
        (SAMPLING + "test_controls_count_the_output_across_preemption",),
        adjust=_adjust_output_folded_on_preemption,
    ),
    "samples_share_one_history": _mutant(
        "the samples of a request penalised by the first one's output",
        (SAMPLING + "test_each_parallel_sample_counts_its_own_output",),
        adjust=_adjust_shared_history,
    ),
    "min_tokens_one_short": _mutant(
        "min_tokens one short",
        tuple(
            SAMPLING + f"test_min_tokens_holds_off_the_stop_exactly_that_long[{s}-{n}]"
            for s in ("eos", "stop_token")
            for n in (1, 3, 6)
        ),
        engine=MinTokensOneShort,
    ),
    "dict_salt_dropped": _mutant(
        "a prompt dict's cache_salt dropped",
        (
            SALT + "test_a_prompt_dicts_salt_isolates_its_prefix[prompt_token_ids]",
            SALT + "test_a_prompt_dicts_salt_isolates_its_prefix[stream]",
            SALT + "test_a_text_prompt_dicts_salt_isolates_its_prefix",
            SALT + "test_a_dict_salt_and_another_cache_salt_argument_are_refused",
        ),
        engine=DictSaltDropped,
    ),
}

# ``--backend sampling_mutants:<name>`` imports this module and calls ``<name>()``.
globals().update({name: m.build for name, m in SAMPLING_MUTANTS.items()})
