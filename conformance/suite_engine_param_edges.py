"""Engine conformance tests of sampling parameters at their edges (specs/engine.md ENG-141,
ENG-120), on the hash model: seeds outside torch's range, stop tokens outside the vocabulary.
Subclass :class:`EngineParamsEdgeSuite` to run these against an engine of yours.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend

from .engine_harness import VOCAB, build_engine

PROMPT = [5, 17, 29, 3, 41, 8, 13, 2, 77]


def samples(
    backend: Backend, params: SamplingParams, prompt: Sequence[int] = PROMPT
) -> list[list[int]]:
    """The tokens of each completion of ``prompt`` run alone on a fresh engine."""
    (out,) = build_engine(backend).run([prompt], params)
    return [list(c.token_ids) for c in out.outputs]


@pytest.mark.requires("engine")
class EngineParamsEdgeSuite:
    """Seeds taken modulo 2^64; stop token ids past the vocabulary accepted."""

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
