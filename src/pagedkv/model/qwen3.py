"""The Qwen3 (dense and MoE) decoder-only language model, run one
:class:`~pagedkv.plan.StepPlan` at a time.

The module tree mirrors the Hugging Face checkpoint so parameter names match its tensor names
one to one (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``, ...). The model reads
nothing but the plan and the store: it keeps no per-sequence state between steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore
from pagedkv.model.attention import Qwen3Attention
from pagedkv.model.config import ModelConfig
from pagedkv.model.layers import RMSNorm, SwiGLUMLP
from pagedkv.model.moe import Qwen3MoeSparseBlock
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.plan import StepPlan


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h += attn(norm(h)); h += mlp(norm(h))``.

    The MLP is the sparse MoE block on a Qwen3-MoE model's sparse layers
    (:meth:`~pagedkv.model.config.MoeConfig.is_sparse`), the dense SwiGLU MLP elsewhere.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer)
        self.mlp: nn.Module = (
            Qwen3MoeSparseBlock(config.hidden_size, config.moe)
            if config.moe is not None and config.moe.is_sparse(layer)
            else SwiGLUMLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: StepPlan,
        store: PagedStore | None,
    ) -> torch.Tensor:
        """``hidden``: ``[T, hidden_size]``; returns the same shape."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, plan, store)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and the final norm (the checkpoint's ``model.*`` tensors)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with its LM head; the LM head is the embedding table when embeddings are tied.

    Build it with :func:`pagedkv.model.loader.load_model`; a freshly constructed one holds
    untrained parameters. Run it under ``torch.inference_mode()`` (or ``no_grad``).

    Args:
        config: the model configuration.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        self.lm_head: nn.Linear | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    if TYPE_CHECKING:  # nn.Module.__call__ is untyped; calling the model runs forward

        def __call__(self, plan: StepPlan, store: PagedStore | None) -> torch.Tensor: ...

    def forward(self, plan: StepPlan, store: PagedStore | None) -> torch.Tensor:
        """Run one step.

        Args:
            plan: the step's tokens, positions, slots and attention batch, on the model's
                device. A v1 plan (with ``slot_mapping``) writes this step's K/V to ``store``
                and attends over the cached context; a v0 plan recomputes whole sequences and
                touches no store.
            store: the PagedStore, shaped for this model (layers, KV heads, head dim);
                required for a v1 plan, ignored for a v0 plan.

        Returns:
            ``[len(plan.logits_indices), vocab_size]`` float32 logits of the rows
            ``plan.logits_indices`` (by default each sequence's last row).

        Raises:
            InvalidRequest: a v1 plan without a store, or a store of another shape.
        """
        if plan.uses_cache:
            self._check_store(store)
        hidden = self.model.embed_tokens(plan.input_ids)
        cos, sin = self.rotary(plan.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, plan, store)
        hidden = self.model.norm(hidden.index_select(0, plan.logits_indices))
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).to(torch.float32)

    def _check_store(self, store: PagedStore | None) -> None:
        if store is None:
            raise InvalidRequest("a plan that uses the KV cache needs a PagedStore")
        shape = store.config
        config = self.config
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
