"""Qwen3 grouped-query self-attention over the step's :class:`StepAttention`.

Per layer: project to q/k/v, RMS-normalise each query and key head (Qwen3's ``q_norm`` and
``k_norm``, before RoPE), rotate q and k by their positions, attend, project back. Where the
keys and values live (a PagedStore in v1, the step's own rows in v0) is the step attention's
business, prepared once per step by the runner (see :mod:`pagedkv.model.step_attention`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.config import ModelConfig
from pagedkv.model.layers import MergedLinear, RMSNorm, RowParallelLinear
from pagedkv.model.step_attention import StepAttention
from pagedkv.model.tensor_parallel import Collectives, ShardLayout


class Qwen3Attention(nn.Module):
    """One layer's attention block. q, k and v are one product (``qkv_proj``, stored in the
    checkpoint as ``q_proj``, ``k_proj`` and ``v_proj``); other names follow the checkpoint.

    Tensor-parallel, the block holds the rank's query heads and K/V heads
    (:class:`~pagedkv.model.tensor_parallel.ShardLayout`): ``qkv_proj`` is column-parallel,
    attention runs on the rank's heads against its own store, and ``o_proj`` is row-parallel.

    Args:
        config: the model configuration.
        layer: index of the layer, the one used in the store.
        layout: the rank's blocks (default: the whole model).
        collectives: the rank's group (none: a group of one).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        layout: ShardLayout | None = None,
        collectives: Collectives | None = None,
    ) -> None:
        super().__init__()
        layout = layout or ShardLayout.of(config)
        self.layer = layer
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        bias = config.attention_bias
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        parts = (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))
        self.qkv_proj = MergedLinear(config.hidden_size, parts, bias=bias)
        self.o_proj = RowParallelLinear(
            q_size, config.hidden_size, bias, collectives, adds_bias=layout.is_first
        )
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: StepAttention,
    ) -> torch.Tensor:
        """Attend this step's tokens.

        Args:
            hidden: ``[T, hidden_size]`` normalised hidden states.
            cos: ``[T, head_dim]`` RoPE table for the plan's positions.
            sin: ``[T, head_dim]``.
            attention: the step's attention, shared by every layer.

        Returns:
            ``[T, hidden_size]``.
        """
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_parts(hidden)
        q = self.q_norm.rotated(q.reshape(tokens, self.num_heads, self.head_dim), cos, sin)
        k = self.k_norm.rotated(k.reshape(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        attended = attention(self.layer, q, k, v, self.scale)
        out: torch.Tensor = self.o_proj(attended.reshape(tokens, self.num_heads * self.head_dim))
        return out
