"""Engine conformance tests of the sampling controls (specs/engine.md ENG-048), on the hash model.

Each test sets a control on requests through the backend's own engine and replays every token
it generated against :func:`~.sampling_reference.controlled_logits`, the control written from
its definition: at each position the token must be the argmax of the reference's logits (to
within float32 rounding for greedy requests; within :data:`COLD_TOLERANCE` for requests sampled
at temperature :data:`COLD`). The stand-in model's logits are lifted so that the few most likely
tokens are positive and the rest negative (the repetition penalty has two branches), and its
vocabulary is small so that outputs repeat tokens (the penalties count them). Each test is built
so that one plausible slip changes a token: a bias that replaces the logit instead of adding to
it, a presence penalty counted per occurrence, a frequency penalty counted once per token, a
repetition penalty blind to the prompt, ``min_tokens`` one short; and the controls hold on
the sampled path, across preemption and for each sample of a parallel request. Subclass
:class:`EngineSamplingSuite` to run these against an engine of yours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import FinishReason, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend, Engine, EngineBackend
from pagedkv.plan import StepPlan
from pagedkv.testing.hash_runner import HashRunner, hash_logits, next_token

from .engine_harness import solo_greedy
from .sampling_reference import controlled_logits

#: The stand-in's vocabulary: small, so a 24-token output repeats tokens.
VOCAB = 13
#: Added to every logit: the peak is 2.0, the tokens 1..3 steps after it positive, 4 steps 0.
LIFT = 2.0
#: How far below the reference's best logit a chosen token may be: float32 rounding only.
TOLERANCE = 1e-4
#: A temperature above the greedy threshold (ENG-046) that leaves sampling nearly greedy, and
#: how far below the best logit a token so drawn may be: ``exp(-COLD_TOLERANCE / COLD)``.
COLD = 1e-3
COLD_TOLERANCE = 0.05
CONFIG = EngineConfig(page_size=4, num_pages=64, max_num_batched_tokens=256, max_model_len=256)
#: Prompts of the replay tests: the second holds most of the vocabulary (the repetition
#: penalty's prompt half), the third repeats one token.
PROMPTS = ([3, 1, 4, 1, 5], [0, 2, 4, 6, 8, 10, 12, 1, 3, 5], [7, 7, 7, 7, 7, 7], [11])


class LiftedHashRunner(HashRunner):
    """The hash stand-in with every logit raised by :data:`LIFT`."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return super().execute(plan) + LIFT


def raw_logits(context: Sequence[int]) -> list[float]:
    """What :class:`LiftedHashRunner` returns after ``context``."""
    return (hash_logits(next_token(list(context), VOCAB), VOCAB) + LIFT).tolist()


def sampling_engine(
    backend: Backend, eos_ids: frozenset[int] = frozenset(), config: EngineConfig = CONFIG
) -> Engine:
    """An engine of ``backend`` with ``config`` over a fresh :class:`LiftedHashRunner`."""
    if not isinstance(backend, EngineBackend):
        raise TypeError(f"backend {backend.name!r} declares 'engine' but has no create_engine")
    runner = LiftedHashRunner(VOCAB, config.num_pages, config.page_size)
    return backend.create_engine(runner, config, eos_ids=eos_ids)


def run_all(
    engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
) -> list[RequestOutput]:
    """Queue every prompt with its params, in one batch; final outputs in prompt order."""
    ids = [engine.add_request(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
    done: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    else:
        raise AssertionError("engine still busy after 10000 steps")
    return [done[i] for i in ids]


def replay(
    prompt: Sequence[int],
    params: SamplingParams,
    tokens: Sequence[int],
    stop_ids: frozenset[int] = frozenset(),
    tolerance: float = TOLERANCE,
) -> None:
    """Every token of ``tokens`` is the argmax of the reference's logits at its position, to
    within ``tolerance``."""
    context = list(prompt)
    for step, token in enumerate(tokens):
        want = controlled_logits(raw_logits(context), params, prompt, tokens[:step], stop_ids)
        best = max(range(VOCAB), key=lambda t: want[t])
        assert want[token] >= want[best] - tolerance, (
            f"position {step} of {list(tokens)} (prompt {list(prompt)}): the engine chose "
            f"{token} at {want[token]:.4f} after the controls, the reference's argmax is "
            f"{best} at {want[best]:.4f}"
        )
        context.append(token)


def greedy(max_tokens: int = 24, **controls: Any) -> SamplingParams:
    """Greedy sampling of ``max_tokens`` tokens with ``controls`` (SamplingParams fields)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **controls)


@pytest.mark.requires("engine")
class EngineSamplingSuite:
    """ENG-048 through the backend's engine: each control against its reference computation."""

    def check(self, backend: Backend, params: SamplingParams) -> None:
        """Every prompt of :data:`PROMPTS` run with ``params`` in one batch replays against the
        reference, and the control changes some output (it is not ignored)."""
        outs = run_all(sampling_engine(backend), PROMPTS, [params] * len(PROMPTS))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            replay(prompt, params, out.token_ids)
            assert len(out.token_ids) == params.max_tokens
        plain = [solo_greedy(p, params.token_limit, VOCAB) for p in PROMPTS]
        assert [list(o.token_ids) for o in outs] != plain, "the control changed nothing"

    @pytest.mark.spec("ENG-048")
    @pytest.mark.parametrize(
        "bias",
        [{0: 0.75, 3: -0.25, 6: 1.5, 9: -1.0}, {1: -0.25, 4: 0.5, 8: 2.5, 12: -3.0}],
        ids=["a", "b"],
    )
    def test_logit_bias_adds_to_the_logit(self, backend: Backend, bias: dict[int, float]) -> None:
        """Biases smaller than the gaps between the stand-in's logits: added, they reorder
        only the tokens near the top; put in place of the logit, they reorder all."""
        self.check(backend, greedy(logit_bias=bias))

    @pytest.mark.spec("ENG-048")
    @pytest.mark.parametrize("penalty", [-1.25, 0.75], ids=["attracts", "repels"])
    def test_presence_penalty_counts_each_output_token_once(
        self, backend: Backend, penalty: float
    ) -> None:
        """A token the output holds twice is penalised as one it holds once, and a prompt
        token the output does not hold is not penalised."""
        self.check(backend, greedy(presence_penalty=penalty))

    @pytest.mark.spec("ENG-048")
    @pytest.mark.parametrize("penalty", [-0.6, 0.4], ids=["attracts", "repels"])
    def test_frequency_penalty_counts_every_occurrence(
        self, backend: Backend, penalty: float
    ) -> None:
        """A token the output holds twice is penalised twice as much as one it holds once."""
        self.check(backend, greedy(frequency_penalty=penalty))

    @pytest.mark.spec("ENG-048")
    @pytest.mark.parametrize("penalty", [2.5, 0.5], ids=["repels", "attracts"])
    def test_repetition_penalty_covers_the_prompt_and_the_output(
        self, backend: Backend, penalty: float
    ) -> None:
        """Tokens of the prompt are penalised from the first position, before the output
        holds them; positive logits are divided, negative ones multiplied."""
        self.check(backend, greedy(repetition_penalty=penalty))

    @pytest.mark.spec("ENG-048")
    @pytest.mark.parametrize("mode", ["v1", "v0"])
    def test_controls_together_in_one_batch(self, backend: Backend, mode: str) -> None:
        """Requests with different controls, and one with none, share every step: each
        replays against its own reference, in v1 and in v0 (recomputing every step)."""
        config = dataclasses.replace(CONFIG, mode="v0" if mode == "v0" else "v1")
        params = [
            greedy(logit_bias={2: 1.25, 5: -0.75}, presence_penalty=0.5),
            greedy(frequency_penalty=-0.3, repetition_penalty=1.5),
            greedy(),
            greedy(presence_penalty=-0.5, repetition_penalty=0.75, logit_bias={7: 0.25}),
        ]
        outs = run_all(sampling_engine(backend, config=config), PROMPTS, params)
        for prompt, sp, out in zip(PROMPTS, params, outs, strict=True):
            replay(prompt, sp, out.token_ids)
        assert list(outs[2].token_ids) == solo_greedy(PROMPTS[2], 24, VOCAB)

    @pytest.mark.spec("ENG-048", "ENG-032")
    def test_controls_count_the_output_across_preemption(self, backend: Backend) -> None:
        """Four penalised requests on a pool of 16 pages, too few for all of them: requests
        are preempted and recomputed, and the tokens generated before a preemption still
        count as output for the penalties and ``min_tokens`` (they are not folded into the
        prompt)."""
        params = greedy(presence_penalty=0.75, frequency_penalty=0.4, min_tokens=24)
        small = dataclasses.replace(CONFIG, num_pages=16, max_num_batched_tokens=16)
        engine = sampling_engine(backend, frozenset({0, 6}), small)
        outs = run_all(engine, PROMPTS, [params] * len(PROMPTS))
        assert engine.stats().preemptions > 0
        for prompt, out in zip(PROMPTS, outs, strict=True):
            replay(prompt, params, out.token_ids, frozenset({0, 6}))
            assert len(out.token_ids) == params.max_tokens

    @pytest.mark.spec("ENG-048", "ENG-047")
    def test_each_parallel_sample_counts_its_own_output(self, backend: Backend) -> None:
        """``n=4`` with penalties, sampled at temperature 1: each sample's penalties count its
        own output, not its siblings', so each equals the same prompt run alone with ``n=1``
        and seed ``seed + i`` (ENG-047)."""
        params = SamplingParams(
            max_tokens=16,
            temperature=1.0,
            seed=21,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            repetition_penalty=1.5,
        )
        (out,) = run_all(sampling_engine(backend), [PROMPTS[0]], [dataclasses.replace(params, n=4)])
        alone = run_all(
            sampling_engine(backend),
            [PROMPTS[0]] * 4,
            [dataclasses.replace(params, seed=21 + i) for i in range(4)],
        )
        assert [c.token_ids for c in out.outputs] == [o.token_ids for o in alone]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 4, "the samples should differ"

    @pytest.mark.spec("ENG-048", "ENG-041")
    def test_controls_apply_when_sampling(self, backend: Backend) -> None:
        """The batch above sampled at temperature :data:`COLD` with seeds: the controls shape
        the distribution sampling draws from, not only the greedy choice. So cold, a token
        :data:`COLD_TOLERANCE` below the best after the controls has probability below
        ``exp(-50)``: each drawn token is the reference's argmax to within that."""
        params = [
            greedy(logit_bias={2: 1.25, 5: -0.75}, presence_penalty=0.5),
            greedy(frequency_penalty=-0.3, repetition_penalty=1.5),
            greedy(min_tokens=20, stop_token_ids=(1, 4)),
            greedy(presence_penalty=-0.5, repetition_penalty=0.75, logit_bias={7: 0.25}),
        ]
        cold = [
            dataclasses.replace(sp, temperature=COLD, seed=seed) for seed, sp in enumerate(params)
        ]
        outs = run_all(sampling_engine(backend), PROMPTS, cold)
        for prompt, sp, out in zip(PROMPTS, cold, outs, strict=True):
            replay(prompt, sp, out.token_ids, tolerance=COLD_TOLERANCE)
        plain = [solo_greedy(p, 24, VOCAB) for p in PROMPTS]
        assert all(list(o.token_ids) != p for o, p in zip(outs, plain, strict=True))

    @pytest.mark.spec("ENG-048", "ENG-042")
    @pytest.mark.parametrize("min_tokens", [1, 3, 6])
    @pytest.mark.parametrize("stopper", ["eos", "stop_token"])
    def test_min_tokens_holds_off_the_stop_exactly_that_long(
        self, backend: Backend, stopper: str, min_tokens: int
    ) -> None:
        """The stopping token (EOS, or a stop token) is the greedy choice at position
        ``min_tokens - 1`` and nowhere before: masked there, it cannot end the output before
        ``min_tokens`` tokens; without ``min_tokens`` it ends it right there."""
        free = solo_greedy(PROMPTS[0], 24, VOCAB)
        at = min_tokens - 1
        stop = free[at]
        assert stop not in free[:at], "pick a prompt whose stopping token is new there"
        eos = frozenset({stop}) if stopper == "eos" else frozenset()
        tokens = (stop,) if stopper == "stop_token" else ()
        plain = greedy(max_tokens=12, stop_token_ids=tokens)
        (early,) = run_all(sampling_engine(backend, eos), [PROMPTS[0]], [plain])
        assert list(early.token_ids) == free[: at + 1]
        held = dataclasses.replace(plain, min_tokens=min_tokens)
        (late,) = run_all(sampling_engine(backend, eos), [PROMPTS[0]], [held])
        assert len(late.token_ids) > min_tokens, list(late.token_ids)
        assert stop not in late.token_ids[:min_tokens]
        replay(PROMPTS[0], held, late.token_ids, eos)
        if late.outputs[0].finish_reason == FinishReason.STOP:
            assert late.token_ids[-1] == stop
