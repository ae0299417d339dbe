"""Engine conformance tests of the sampling controls against a reference computation
(specs/engine.md ENG-048), on the hash model lifted so that the repetition penalty's two
branches both apply.

The reference (:func:`~pagedkv_conformance.sampling_reference.controlled_logits`) applies each
control to one row in plain Python, in vLLM's order: ``min_tokens`` masks EOS and stop tokens,
``logit_bias`` adds, then the repetition, frequency and presence penalties. A greedy request
must pick, at every step, the argmax of the reference's logits.
Subclass :class:`EngineControlSuite` to run these against an engine of yours.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend, EngineBackend
from pagedkv.plan import SeqChunk, StepPlan
from pagedkv.plan_builders import build_recompute_plan
from pagedkv.testing.hash_runner import HashRunner

from .engine_harness import EngineUnderTest
from .sampling_reference import controlled_logits

VOCAB = 37
EOS = frozenset({5})


class ShiftedRunner(HashRunner):
    """The hash stand-in with logits lifted by 2: the next few tokens have positive logits,
    the rest negative."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return super().execute(plan) + 2.0


def random_params(rng: random.Random) -> SamplingParams:
    """Greedy, with controls drawn at random, each absent now and then."""
    maybe = rng.random
    return SamplingParams(
        max_tokens=20,
        temperature=0.0,
        presence_penalty=rng.uniform(-2, 2) if maybe() < 0.6 else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if maybe() < 0.6 else 0.0,
        repetition_penalty=rng.uniform(0.2, 3.0) if maybe() < 0.6 else 1.0,
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))},
        min_tokens=rng.randint(0, 6),
        stop_token_ids=tuple(rng.sample(range(VOCAB), rng.randint(0, 2))),
    )


def replay(prompt: Sequence[int], params: SamplingParams, tokens: Sequence[int]) -> None:
    """Every generated token is the argmax of the reference's logits at its step."""
    context = list(prompt)
    for step, token in enumerate(tokens):
        plan = build_recompute_plan([SeqChunk(tuple(context), 0)])
        logits = ShiftedRunner(VOCAB).execute(plan)[0].tolist()
        processed = controlled_logits(logits, params, prompt, tokens[:step], EOS)
        best = max(range(VOCAB), key=lambda t: processed[t])
        assert token == best, f"step {step}: picked {token}, the controls make {best} the argmax"
        context.append(token)


def shifted_engine(backend: Backend) -> EngineUnderTest:
    """The backend's engine over the lifted hash model, EOS token 5."""
    assert isinstance(backend, EngineBackend)
    config = EngineConfig(page_size=4, num_pages=64, max_model_len=128)
    runner = ShiftedRunner(VOCAB, config.num_pages, config.page_size)
    return EngineUnderTest(backend.create_engine(runner, config, eos_ids=EOS), runner, config)


@pytest.mark.requires("engine")
class EngineControlSuite:
    """Penalties, bias and ``min_tokens`` as vLLM defines them."""

    @pytest.mark.spec("ENG-048")
    @pytest.mark.parametrize("seed", range(4))
    def test_the_engine_picks_the_reference_argmax(self, backend: Backend, seed: int) -> None:
        """Four greedy requests with random controls, batched together: at every step each
        picks the argmax of its reference logits, never stopping before ``min_tokens``; the
        controls visibly change the outputs."""
        rng = random.Random(100 + seed)
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 11))] for _ in range(4)]
        params = [random_params(rng) for _ in prompts]
        outs = shifted_engine(backend).run(prompts, params)
        plain = shifted_engine(backend).run(prompts, SamplingParams(max_tokens=20, temperature=0))
        for prompt, p, out in zip(prompts, params, outs, strict=True):
            replay(prompt, p, out.token_ids)
            assert len(out.token_ids) >= p.min_tokens
        assert [o.token_ids for o in outs] != [o.token_ids for o in plain]
