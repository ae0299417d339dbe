"""Qwen3 grouped-query self-attention, over this step's tokens (v0) or a PagedStore (v1).

Per layer: project to q/k/v, RMS-normalise each query and key head (Qwen3's ``q_norm`` and
``k_norm``, before RoPE), rotate q and k by their positions, attend, project back.

* v0 plan (``plan.slot_mapping is None``): each sequence's rows are its whole context, so
  attention is plain causal attention within each sequence's rows of this step.
* v1 plan: the step's K/V are written to the store at ``plan.slot_mapping`` first, then the
  store attends over each sequence's paged context.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore
from pagedkv.model.config import ModelConfig
from pagedkv.model.layers import RMSNorm, apply_rotary
from pagedkv.plan import StepPlan


def causal_attention_per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence's rows, no cache.

    Args:
        query: ``[T, num_heads, head_dim]``.
        key: ``[T, num_kv_heads, head_dim]``; ``num_kv_heads`` divides ``num_heads``.
        value: ``[T, num_kv_heads, head_dim]``.
        query_start: ``[B+1]`` row offsets; sequence ``b``'s rows are its positions ``0..``.
        scale: softmax scale applied to ``q . k``.

    Returns:
        ``[T, num_heads, head_dim]``.
    """
    out = torch.empty_like(query)
    starts = [int(x) for x in query_start.tolist()]
    for start, stop in itertools.pairwise(starts):
        if stop <= start:
            raise InvalidRequest(f"a sequence owns no query rows ({start}:{stop})")
        # 4-D inputs (a batch of one): unbatched 3-D ones miss the fused CPU kernel.
        rows = F.scaled_dot_product_attention(
            query[None, start:stop].transpose(1, 2),
            key[None, start:stop].transpose(1, 2),
            value[None, start:stop].transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[start:stop] = rows[0].transpose(0, 1)
    return out


class Qwen3Attention(nn.Module):
    """One layer's attention block; parameter names follow the Hugging Face checkpoint.

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
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: StepPlan,
        store: PagedStore | None,
    ) -> torch.Tensor:
        """Attend this step's tokens.

        Args:
            hidden: ``[T, hidden_size]`` normalised hidden states.
            cos: ``[T, head_dim]`` RoPE table for the plan's positions.
            sin: ``[T, head_dim]``.
            plan: the step plan.
            store: required when the plan uses the cache; written at ``plan.slot_mapping``.

        Returns:
            ``[T, hidden_size]``.
        """
        tokens = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if plan.slot_mapping is None:
            attended = causal_attention_per_sequence(
                q, k, v, plan.attention.query_start, self.scale
            )
        else:
            if store is None:
                raise InvalidRequest("a plan that uses the KV cache needs a PagedStore")
            store.write(self.layer, plan.slot_mapping, k, v)
            attended = store.attention(self.layer, q, plan.attention, self.scale)
        out: torch.Tensor = self.o_proj(attended.reshape(tokens, self.num_heads * self.head_dim))
        return out
