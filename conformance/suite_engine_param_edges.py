"""Engine conformance tests of sampling parameters at their edges (specs/engine.md ENG-046,
ENG-140, ENG-141, ENG-120), on the hash model: temperatures too small to divide by, requests
without a seed, seeds outside torch's range, stop tokens outside the vocabulary.
Subclass :class:`EngineParamsEdgeSuite` to run these against an engine of yours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.params import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    FLOAT_FIELDS,
    InvalidSamplingParams,
    SamplingParams,
)
from pagedkv.interfaces import Backend, EngineBackend
from pagedkv.plan import StepPlan
from pagedkv.testing.hash_runner import HashRunner

from .engine_harness import VOCAB, build_engine, solo_greedy

PROMPT = [5, 17, 29, 3, 41, 8, 13, 2, 77]
#: Float edge values every float sampling field is tried with (ENG-178): zeros, subnormals,
#: the extremes of float64 and float32, infinities, NaN and ordinary values either side of
#: each field's range.
FLOAT_EDGES = (
    0.0,
    -0.0,
    5e-324,
    -5e-324,
    1e-310,
    1e-45,
    1e-40,
    FLOAT32_TINY,
    1e-308,
    -1e-308,
    1e-10,
    0.5,
    1.0,
    2.0,
    -2.0,
    100.0,
    -100.0,
    FLOAT32_MAX,
    1e39,
    1e308,
    -1e308,
    math.inf,
    -math.inf,
    math.nan,
)
#: Tokens each edge run asks for.
EDGE_TOKENS = 6


def edge_params(field: str, value: float, **others: object) -> SamplingParams:
    """``SamplingParams`` with ``field`` (a float field, or one ``logit_bias`` value) set to
    ``value``; raises ``InvalidSamplingParams`` where the value is refused."""
    if field == "logit_bias":
        return SamplingParams(logit_bias={3: value}, **others)  # type: ignore[arg-type]
    return SamplingParams(**{field: value}, **others)  # type: ignore[arg-type]


def samples(
    backend: Backend, params: SamplingParams, prompt: Sequence[int] = PROMPT
) -> list[list[int]]:
    """The tokens of each completion of ``prompt`` run alone on a fresh engine."""
    (out,) = build_engine(backend).run([prompt], params)
    return [list(c.token_ids) for c in out.outputs]


class RaisedLogitsRunner(HashRunner):
    """The hash stand-in with its logits lifted to a real model's size: the top one is about
    +40, so dividing them by a temperature of 1e-40 overflows float32."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return super().execute(plan) + 40.0


@pytest.mark.requires("engine")
class EngineParamsEdgeSuite:
    """Tiny temperatures greedy; seeds of their own, seeds taken modulo 2^64; stop token ids
    past the vocabulary accepted."""

    @pytest.mark.spec("ENG-046")
    @pytest.mark.parametrize("temperature", [1e-40, 5e-324])
    def test_a_temperature_below_the_epsilon_is_greedy(
        self, backend: Backend, temperature: float
    ) -> None:
        """Logits of a real model's size; one batch holds a request at a tiny positive
        temperature, one at temperature 0 and one sampling at 0.8: the tiny one gives the
        greedy tokens and no step fails."""
        assert isinstance(backend, EngineBackend)
        config = EngineConfig(page_size=4, num_pages=64, max_model_len=128)
        engine = backend.create_engine(RaisedLogitsRunner(VOCAB, 64, 4), config)
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14]]
        ids = [
            engine.add_request(prompts[0], SamplingParams(max_tokens=12, temperature=temperature)),
            engine.add_request(prompts[1], SamplingParams(max_tokens=12, temperature=0.0)),
            engine.add_request(prompts[2], SamplingParams(max_tokens=12, temperature=0.8, seed=3)),
        ]
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert [finals[i].error for i in ids] == [None] * 3
        assert list(finals[ids[0]].token_ids) == solo_greedy(prompts[0], 12)
        assert list(finals[ids[1]].token_ids) == solo_greedy(prompts[1], 12)

    @pytest.mark.spec("ENG-140")
    def test_unseeded_requests_sample_apart_and_leave_the_global_generator(
        self, backend: Backend
    ) -> None:
        """Forty unseeded requests of one prompt in one engine draw seeds of their own: no two
        sample the same ten tokens (at temperature 2 over 101 tokens, seeds from a narrow range
        or one shared seed would repeat), and torch's global generator gives the program the
        same numbers as if no engine had sampled."""
        torch.manual_seed(1234)
        expected = torch.rand(4)
        torch.manual_seed(1234)
        eut = build_engine(backend, num_pages=256, max_num_seqs=64)
        outs = eut.run([PROMPT] * 40, SamplingParams(max_tokens=10, temperature=2.0))
        assert torch.equal(torch.rand(4), expected), "the engine drew from torch's generator"
        assert len({tuple(out.token_ids) for out in outs}) == 40, "unseeded requests sampled alike"

    @pytest.mark.spec("ENG-141", "ENG-047")
    def test_seeds_equal_modulo_two_to_the_64_sample_alike(self, backend: Backend) -> None:
        """Seeds -1 and 2^64 - 1 sample alike, and the second sequence of a request seeded
        2^64 - 1 samples as one seeded 0 (its seed plus one, modulo 2^64)."""
        wrapped = samples(
            backend, SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 1, n=2)
        )
        negative = samples(backend, SamplingParams(max_tokens=6, temperature=1.0, seed=-1))
        zero = samples(backend, SamplingParams(max_tokens=6, temperature=1.0, seed=0))
        assert wrapped[0] == negative[0], "seeds -1 and 2^64 - 1 sampled apart"
        assert wrapped[1] == zero[0], "seed 2^64 - 1 plus one did not sample as seed 0"

    @pytest.mark.spec("ENG-120")
    def test_stop_tokens_outside_the_vocabulary_are_accepted_and_end_nothing(
        self, backend: Backend
    ) -> None:
        """Stop token ids at and past the vocabulary's end, with ``min_tokens``: the request
        runs as it does without them (the ids it can generate still held back until
        ``min_tokens``), and never fails."""
        prompt = [7, 8, 9]
        held = SamplingParams(max_tokens=8, temperature=0, min_tokens=5, stop_token_ids=(3,))
        (want,) = build_engine(backend).run([prompt], held)
        outside = SamplingParams(
            max_tokens=8, temperature=0, min_tokens=5, stop_token_ids=(3, VOCAB, VOCAB + 1)
        )
        (got,) = build_engine(backend).run([prompt], outside)
        assert got.error is None
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason

    @pytest.mark.spec("ENG-178")
    @pytest.mark.parametrize("field", [*FLOAT_FIELDS, "logit_bias"])
    def test_every_float_edge_is_refused_or_runs_to_its_tokens(
        self, backend: Backend, field: str
    ) -> None:
        """Every edge value of the field, at temperature 1 (and greedy where the field is
        not the temperature), seeded: refused naming the field, or run on the backend's engine
        to all its tokens (the hash model has no EOS here), never a short or empty output; a
        ``top_p`` below float32's smallest normal number keeps exactly the top token, so its
        run is the greedy one. Fails an engine that reads such a ``top_p`` as no filter, or
        whose sampler draws from an emptied distribution."""
        temperatures: list[float | None] = [None] if field == "temperature" else [1.0, 0.0]
        for value in FLOAT_EDGES:
            for temperature in temperatures:
                others: dict[str, object] = {"max_tokens": EDGE_TOKENS, "seed": 5}
                if temperature is not None:
                    others["temperature"] = temperature
                refused: InvalidSamplingParams | None = None
                try:
                    params = edge_params(field, value, **others)
                except InvalidSamplingParams as exc:
                    refused = exc
                if refused is not None:
                    assert str(refused).startswith(field), (value, refused)
                    continue
                (out,) = build_engine(backend).run([PROMPT], params)
                (completion,) = out.outputs
                tokens = list(completion.token_ids)
                assert len(tokens) == EDGE_TOKENS, (field, value, temperature, tokens)
                assert completion.finish_reason == "length", (field, value, temperature)
                if field == "top_p" and 0 < value < FLOAT32_TINY:
                    assert tokens == solo_greedy(PROMPT, EDGE_TOKENS), (value, temperature)
