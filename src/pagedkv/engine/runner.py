"""The model runner: owns the model and its PagedStore, and runs one step plan."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedkv.interfaces import PagedStore, StoreConfig
from pagedkv.kv.paged_store import TorchPagedStore
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.plan import StepPlan


class ModelRunner:
    """Runs plans on a model; the only place the engine's work meets tensors of the model.

    Attributes:
        model: the Qwen3 model.
        store: its paged K/V pool, ``None`` when the engine recomputes everything (v0).
    """

    def __init__(self, model: Qwen3ForCausalLM, store: PagedStore | None) -> None:
        self.model = model
        self.store = store

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> ModelRunner:
        """Load a checkpoint; with ``num_pages`` set, preallocate its K/V pool once."""
        model = load_model(model_dir, dtype=dtype, device=device)
        store = None
        if num_pages is not None:
            cfg = model.config
            store = TorchPagedStore(
                StoreConfig(
                    num_layers=cfg.num_hidden_layers,
                    num_kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.head_dim,
                    page_size=page_size,
                    num_pages=num_pages,
                    dtype=dtype,
                    device=device,
                )
            )
        return cls(model, store)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_positions(self) -> int:
        return self.model.config.max_positions

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32, on the CPU) at each sequence's last scheduled row."""
        with torch.inference_mode():
            logits: torch.Tensor = self.model(plan, self.store if plan.uses_cache else None)
        return logits.float().cpu()
