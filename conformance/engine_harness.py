"""Helpers the engine conformance tests share: building engines over the hash runner and
computing what each request must produce when run alone."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.interfaces import Backend, Engine, EngineBackend
from pagedkv.testing.hash_runner import HashRunner, next_token

VOCAB = 101


def greedy(params: SamplingParams | None = None, max_tokens: int = 12) -> SamplingParams:
    """Greedy sampling with ``max_tokens``."""
    return params or SamplingParams(max_tokens=max_tokens, temperature=0.0)


def solo_greedy(prompt: Sequence[int], max_tokens: int, vocab: int = VOCAB) -> list[int]:
    """What greedy decoding of ``prompt`` alone yields on the hash model."""
    context = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        token = next_token(context, vocab)
        out.append(token)
        context.append(token)
    return out


def prompts_with_shared_prefix(
    count: int, prefix_len: int, seed: int = 0, max_suffix: int = 9
) -> list[list[int]]:
    """``count`` prompts sharing one random ``prefix_len``-token prefix, each with a suffix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    return [
        prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_suffix))]
        for _ in range(count)
    ]


@dataclass
class EngineUnderTest:
    """An engine built by the backend, with the hash runner it runs on."""

    engine: Engine
    runner: HashRunner
    config: EngineConfig

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Queue every prompt, step to completion; final outputs in prompt order."""
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [
            self.engine.add_request(list(p), sp, cache_salt=cache_salt)
            for p, sp in zip(prompts, per, strict=True)
        ]
        return self.finish(ids)

    def finish(self, ids: Sequence[str], max_steps: int = 10_000) -> list[RequestOutput]:
        """Step until nothing is left; final outputs of ``ids`` in that order."""
        done: dict[str, RequestOutput] = {}
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = output
            self.engine.check_invariants()
        else:
            raise AssertionError(f"engine still busy after {max_steps} steps")
        return [done[i] for i in ids]


def build_engine(
    backend: Backend,
    *,
    page_size: int = 4,
    num_pages: int = 64,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 8,
    max_model_len: int = 512,
    enable_prefix_caching: bool = True,
    mode: str = "v1",
    eos_ids: frozenset[int] = frozenset(),
    tokenizer: Tokenizer | None = None,
    vocab: int = VOCAB,
) -> EngineUnderTest:
    """An engine of ``backend`` over a fresh hash runner of ``vocab`` tokens sized like its
    page pool, with ``tokenizer`` for text."""
    if not isinstance(backend, EngineBackend):
        raise TypeError(f"backend {backend.name!r} declares 'engine' but has no create_engine")
    config = EngineConfig(
        page_size=page_size,
        num_pages=num_pages,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        mode="v0" if mode == "v0" else "v1",
    )
    runner = HashRunner(vocab, num_pages, page_size)
    engine = backend.create_engine(runner, config, tokenizer=tokenizer, eos_ids=eos_ids)
    return EngineUnderTest(engine, runner, config)
