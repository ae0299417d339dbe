"""The model runner: owns the model and its cache mode, and runs one step plan.

Per step it prepares the step's attention from the plan once (every check and all host work:
the layout of the ragged batch, the store's metadata) and hands that immutable object to every
layer. Its cache mode is chosen once, at construction: :meth:`ModelRunner.paged` (v1, over a
PagedStore) or :meth:`ModelRunner.recompute` (v0, no cache).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore, StoreConfig
from pagedkv.kv.paged_store import TorchPagedStore
from pagedkv.model.loader import load_model
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.step_attention import PagedStepAttention, RecomputeStepAttention, StepAttention
from pagedkv.plan import StepPlan

#: Turns a step plan into the step's attention (validating the plan against the cache mode).
PrepareAttention = Callable[[StepPlan], StepAttention]


class ModelRunner:
    """Runs plans on a model; the only place the engine's work meets tensors of the model.

    Build it with :meth:`paged`, :meth:`recompute` or :meth:`from_model_dir`.

    Attributes:
        model: the Qwen3 model.
    """

    def __init__(
        self, model: Qwen3ForCausalLM, prepare: PrepareAttention, store: PagedStore | None = None
    ) -> None:
        self.model = model
        self._prepare = prepare
        self._store = store

    @classmethod
    def paged(cls, model: Qwen3ForCausalLM, store: PagedStore) -> ModelRunner:
        """A runner for v1 plans, writing and reading K/V in ``store``.

        Raises:
            InvalidRequest: the store is not shaped for the model (layers, KV heads, head dim).
        """
        shape, config = store.config, model.config
        if (shape.num_layers, shape.num_kv_heads, shape.head_dim) != (
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
        ):
            raise InvalidRequest(
                f"store holds {shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
                f"{shape.head_dim} channels; the model needs {config.num_hidden_layers} x "
                f"{config.num_key_value_heads} x {config.head_dim}"
            )
        return cls(model, partial(PagedStepAttention.prepare, store), store)

    @classmethod
    def recompute(cls, model: Qwen3ForCausalLM) -> ModelRunner:
        """A runner for cache-less (v0) plans; it keeps no K/V."""
        return cls(model, RecomputeStepAttention.prepare)

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
        """Load a checkpoint; with ``num_pages`` set, preallocate its K/V pool once and run v1
        plans, else run v0 plans."""
        model = load_model(model_dir, dtype=dtype, device=device)
        if num_pages is None:
            return cls.recompute(model)
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
        return cls.paged(model, store)

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
        """Logits ``[B, vocab]`` (float32, on the CPU) at each sequence's last scheduled row.

        Raises:
            InvalidRequest: a plan of the other cache mode, or one the store refuses.
        """
        with torch.inference_mode():
            attention = self._prepare(plan)
            if plan.page_copies is not None:
                if self._store is None:
                    raise InvalidRequest("a cache-less runner has no pages to copy")
                self._store.copy_pages(plan.page_copies[0], plan.page_copies[1])
            logits: torch.Tensor = self.model(plan, attention)
        return logits.float().cpu()
