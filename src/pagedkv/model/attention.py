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
from pagedkv.model.layers import Linear, MergedLinear, RMSNorm, apply_rotary
from pagedkv.model.step_attention import StepAttention


class Qwen3Attention(nn.Module):
    """One layer's attention block. q, k and v are one product (``qkv_proj``, stored in the
    checkpoint as ``q_proj``, ``k_proj`` and ``v_proj``); other names follow the checkpoint.

    Args:
        config: the model configuration.
        layer: index of the layer, the one used in the store.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        bias = config.attention_bias
        parts = (("q_proj", config.q_size), ("k_proj", config.kv_size), ("v_proj", config.kv_size))
        self.qkv_proj = MergedLinear(config.hidden_size, parts, bias=bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=bias)
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
        q = self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        attended = attention(self.layer, q, k, v, self.scale)
        out: torch.Tensor = self.o_proj(attended.reshape(tokens, self.num_heads * self.head_dim))
        return out
