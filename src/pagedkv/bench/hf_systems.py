"""The transformers baselines: ``generate`` on static padded batches, and transformers' own
continuous batching (the manager behind ``generate_batch``).

Both decode greedily and generate exactly each request's ``max_tokens``, like pagedkv's runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.requests import BenchRequest
from pagedkv.bench.run import RunResult
from pagedkv.device import DEFAULT_DEVICE

#: Name of the static-batch ``generate`` system in the results.
HF_GENERATE = "hf-generate"
#: Name of transformers' continuous batching in the results.
HF_GENERATE_BATCH = "hf-generate-batch"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(
    checkpoint: Checkpoint, dtype: str = "float32", device: str = DEFAULT_DEVICE
) -> Any:
    """The checkpoint as a transformers ``Qwen3ForCausalLM`` (SDPA attention, eval mode)."""
    from transformers import Qwen3ForCausalLM

    model_class: Any = Qwen3ForCausalLM
    model = model_class.from_pretrained(
        str(checkpoint.path), dtype=_DTYPES[dtype], attn_implementation="sdpa"
    )
    return model.to(device).eval()


class TokenClock:
    """A ``generate`` streamer that records when each new batch of tokens appears.

    ``generate`` calls ``put`` once with the prompt, then once per generated position.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._calls = 0

    def put(self, value: torch.Tensor) -> None:
        """Record the time of a generated position (the first call is the prompt)."""
        self._calls += 1
        if self._calls > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush."""


def run_generate_static(
    model: Any, requests: Sequence[BenchRequest], batch_size: int, pad_token_id: int = 0
) -> RunResult:
    """``generate`` over consecutive batches of ``batch_size`` requests, in arrival order.

    Each batch is left-padded to its longest prompt (with an attention mask) and runs until its
    longest output; only each request's own ``max_tokens`` count as output. All requests are
    submitted at the start, so a request's TTFT includes the batches before its own.
    """
    start = time.perf_counter()
    ttft: list[float] = []
    decode_s: list[float] = []
    decode_tokens: list[int] = []
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        clock = _generate_batch(model, batch, pad_token_id)
        for request in batch:
            ttft.append(clock.times[0] - start)
            decode_s.append(clock.times[request.max_tokens - 1] - clock.times[0])
            decode_tokens.append(request.max_tokens - 1)
    wall = time.perf_counter() - start
    return RunResult(
        system=HF_GENERATE,
        output_tokens=sum(r.max_tokens for r in requests),
        wall_s=wall,
        ttft_s=tuple(ttft),
        decode_s=tuple(decode_s),
        decode_tokens=tuple(decode_tokens),
    )


def _generate_batch(model: Any, batch: Sequence[BenchRequest], pad_token_id: int) -> TokenClock:
    from transformers import GenerationConfig

    width = max(len(r.prompt) for r in batch)
    ids = [[pad_token_id] * (width - len(r.prompt)) + list(r.prompt) for r in batch]
    mask = [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch]
    new_tokens = max(r.max_tokens for r in batch)
    config_class: Any = GenerationConfig
    config = config_class(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
        eos_token_id=None,
    )
    clock = TokenClock()
    device = model.device
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            attention_mask=torch.tensor(mask, dtype=torch.int64, device=device),
            generation_config=config,
            streamer=clock,
        )
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"generate stopped at {out.shape[1] - width} of {new_tokens} tokens")
    return clock


def has_generate_batch(model: Any) -> bool:
    """Whether the installed transformers offers continuous batching on this model."""
    return hasattr(model, "generate_batch") and hasattr(
        model, "continuous_batching_context_manager"
    )


def run_generate_batch(
    model: Any,
    requests: Sequence[BenchRequest],
    *,
    page_size: int,
    num_blocks: int,
    max_batch_tokens: int,
    max_requests_per_batch: int,
) -> RunResult:
    """transformers' continuous batching over the requests, all submitted at the start.

    ``generate_batch`` gives every request the same ``max_new_tokens``, so the requests are
    submitted one by one, each with its own, to the manager ``generate_batch`` itself drives
    (``continuous_batching_context_manager``). The manager is created and started (its cache
    allocated) before the clock starts, as pagedkv's engine is built before its clock starts.
    The cache is shaped like pagedkv's: ``num_blocks`` pages of ``page_size`` tokens, the same
    token budget per step and the same sequences per step.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config_class: Any = GenerationConfig
    generation = config_class(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in requests),
        eos_token_id=-1,
        pad_token_id=0,
    )
    batching = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
    )
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=batching,
        warmup=False,
        block=True,
        timeout=30,
    ) as manager:
        start = time.perf_counter()
        ids = [
            manager.add_request(
                list(r.prompt),
                request_id=f"bench-{i}",
                max_new_tokens=r.max_tokens,
                record_timestamps=True,
            )
            for i, r in enumerate(requests)
        ]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped unexpectedly")
        wall = time.perf_counter() - start
    ordered = [results[i] for i in ids]
    for result in ordered:
        if result.error:
            raise RuntimeError(f"generate_batch request failed: {result.error}")
    return RunResult(
        system=HF_GENERATE_BATCH,
        output_tokens=sum(len(r.generated_tokens) for r in ordered),
        wall_s=wall,
        ttft_s=tuple(r.timestamps[0] - start for r in ordered),
        decode_s=tuple(r.timestamps[-1] - r.timestamps[0] for r in ordered),
        decode_tokens=tuple(len(r.generated_tokens) - 1 for r in ordered),
    )


@dataclass(frozen=True, slots=True)
class HfGenerate:
    """transformers ``generate`` on static batches as a
    :class:`~pagedkv.bench.system.SystemUnderTest` (see :func:`run_generate_static`).

    Attributes:
        model: the loaded model (:func:`load_hf_model`).
        batch_size: requests per batch; ``None``: every request of a run in one batch.
        name: the system's name in the results.
    """

    model: Any
    batch_size: int | None = None
    name: str = HF_GENERATE

    def run(self, requests: Sequence[BenchRequest]) -> RunResult:
        """The requests in consecutive static batches, in arrival order."""
        size = self.batch_size if self.batch_size is not None else len(requests)
        return run_generate_static(self.model, requests, batch_size=size)


@dataclass(frozen=True, slots=True)
class HfGenerateBatch:
    """transformers' continuous batching as a :class:`~pagedkv.bench.system.SystemUnderTest`
    (see :func:`run_generate_batch`), its cache shaped like pagedkv's.

    Attributes:
        model: the loaded model (:func:`load_hf_model`).
        page_size: tokens per cache page.
        num_blocks: pages of the cache.
        max_batch_tokens: token budget of one step.
        max_requests_per_batch: sequences of one step.
        name: the system's name in the results.
    """

    model: Any
    page_size: int
    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int
    name: str = HF_GENERATE_BATCH

    def run(self, requests: Sequence[BenchRequest]) -> RunResult:
        """The requests through a manager started before the clock."""
        return run_generate_batch(
            self.model,
            requests,
            page_size=self.page_size,
            num_blocks=self.num_blocks,
            max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.max_requests_per_batch,
        )
