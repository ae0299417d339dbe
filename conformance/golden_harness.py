"""Builds the tiny checkpoints once per run and computes transformers' greedy outputs on them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.engine.config import CacheMode, EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend, Engine, EngineBackend, KVManagerConfig, ModelBackend
from pagedkv.plan import StepPlan
from pagedkv.testing.tiny_qwen3 import (
    build_tiny_checkpoint,
    load_hf_reference,
    preset_spec,
    reference_logits,
)

#: Generated tokens per prompt: at page size 1 and 5 this crosses many pages.
NEW_TOKENS = 40
#: Prompt lengths: 16 is a multiple of the page sizes 1 and 16, 15 of 5; 23 divides none; 1.
PROMPT_LENGTHS = (16, 15, 23, 1)


def golden_prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    """The batch of prompts of different lengths, drawn with a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@dataclass
class GoldenCheckpoints:
    """Tiny checkpoints and transformers' outputs on them, computed once and reused."""

    root: Path
    _paths: dict[tuple[str, str], Path] = field(default_factory=dict)
    _refs: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    _expected: dict[tuple[str, str, str], list[list[int]]] = field(default_factory=dict)

    def path(self, preset: str, dtype: str = "float32") -> Path:
        key = (preset, dtype)
        if key not in self._paths:
            self._paths[key] = build_tiny_checkpoint(
                preset_spec(preset), self.root / f"{preset}-{dtype}", dtype=dtype
            )
        return self._paths[key]

    def reference(self, preset: str, dtype: str, device: str) -> Any:
        key = (preset, dtype, device)
        if key not in self._refs:
            self._refs[key] = load_hf_reference(self.path(preset, dtype), dtype, device)
        return self._refs[key]

    def expected(self, preset: str, dtype: str = "float32", device: str = "cpu") -> list[list[int]]:
        """transformers' greedy ``generate`` from each golden prompt, EOS ignored."""
        key = (preset, dtype, device)
        if key not in self._expected:
            model = self.reference(preset, dtype, device)
            outputs = hf_greedy(model, golden_prompts(preset_spec(preset).vocab), NEW_TOKENS)
            self._expected[key] = outputs
        return self._expected[key]

    def top2_margin(self, preset: str, dtype: str, device: str, context: Sequence[int]) -> float:
        """transformers' top-1 minus top-2 logit after ``context``."""
        logits = reference_logits(self.reference(preset, dtype, device), context)[-1]
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])


def hf_greedy(model: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate``, one prompt at a time, exactly ``max_tokens`` each.

    The attention mask is explicit: token 0 is an ordinary token of these prompts, and
    ``generate`` would otherwise take it for padding.
    """
    device = next(model.parameters()).device
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], device=device)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def load_hf_eager(path: str | Path, device: str) -> Any:
    """A local checkpoint loaded by transformers in float32 with eager attention."""
    from transformers import AutoModelForCausalLM

    auto_model: Any = AutoModelForCausalLM
    return auto_model.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).to(device)


class CountingRunner:
    """Wraps a runner and records how many positions each step fed to the model."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tokens_per_step: list[int] = []

    @property
    def device(self) -> torch.device:
        device: torch.device = self.inner.device
        return device

    @property
    def vocab_size(self) -> int:
        return int(self.inner.vocab_size)

    @property
    def max_positions(self) -> int | None:
        limit: int | None = self.inner.max_positions
        return limit

    def execute(self, plan: StepPlan) -> torch.Tensor:
        self.tokens_per_step.append(plan.num_tokens)
        logits: torch.Tensor = self.inner.execute(plan)
        return logits


def model_engine(
    backend: Backend,
    model_dir: Path,
    *,
    page_size: int,
    mode: CacheMode,
    dtype: str = "float32",
    device: str = "cpu",
    num_pages: int = 512,
    **options: Any,
) -> tuple[Engine, CountingRunner]:
    """The backend's model runner under the backend's engine (or pagedkv's, fed the backend's
    KVManager, when it declares no ``engine``); ``options`` are further ``EngineConfig``
    fields."""
    if not isinstance(backend, ModelBackend):
        raise TypeError(f"backend {backend.name!r} declares 'model' but has no create_model_runner")
    runner = CountingRunner(
        backend.create_model_runner(
            str(model_dir),
            num_pages=num_pages if mode == "v1" else None,
            page_size=page_size,
            dtype=dtype,
            device=device,
        )
    )
    config = EngineConfig(page_size=page_size, num_pages=num_pages, mode=mode, **options)
    if isinstance(backend, EngineBackend) and "engine" in backend.capabilities:
        return backend.create_engine(runner, config), runner
    from pagedkv.engine.engine import LLMEngine

    kv = (
        backend.create_kv_manager(
            KVManagerConfig(num_pages, page_size, config.enable_prefix_caching)
        )
        if mode == "v1"
        else None
    )
    return LLMEngine(runner, config, kv_manager=kv), runner


def greedy_outputs(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    """Greedy, EOS ignored, ``max_tokens`` each, as one batch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in run_to_completion(engine, prompts, params)]
