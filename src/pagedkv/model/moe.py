"""The sparse mixture-of-experts MLP of Qwen3-MoE: a router and a bank of SwiGLU experts.

Numerics follow transformers' ``Qwen3MoeSparseMoeBlock``: router logits ``h @ gate.T`` in the
activation dtype; softmax over all experts in float32; the top-k probabilities, renormalised to
sum to 1 when ``norm_topk_prob``, cast back to the activation dtype; each token's output is the
weighted sum of its k experts' ``down(silu(gate(h)) * up(h))``.

Experts are computed batched: the (token, expert) pairs are sorted by expert, each expert with
work runs one pair of matrix products over all its rows, and the results are put back in pair
order and summed per token. The loop is over experts (at most ``num_experts`` per layer, skipping
idle ones), never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pagedkv.model.config import MoeConfig
from pagedkv.model.layers import swiglu
from pagedkv.model.tensor_parallel import Collectives, SingleRank


class Qwen3MoeExperts(nn.Module):
    """Every expert's weights, stacked (transformers' in-memory layout).

    Checkpoints store one tensor per expert and projection (``experts.{e}.gate_proj.weight``,
    ``up_proj``, ``down_proj``); the loader copies them into these slices.

    Tensor-parallel, every rank holds every expert, each with its block of the hidden layer
    (``intermediate`` rows of gate and of up, the matching columns of down): the output is
    then this rank's partial sum, which the sparse block all-reduces.

    Attributes:
        gate_up_proj: ``[num_experts, 2 * intermediate, hidden]``, each expert's
            ``gate_proj`` rows then its ``up_proj`` rows.
        down_proj: ``[num_experts, hidden, intermediate]``.
    """

    def __init__(self, hidden_size: int, moe: MoeConfig, intermediate: int | None = None) -> None:
        """``intermediate``: rows of each expert's hidden layer held (default: all,
        ``moe.moe_intermediate_size``)."""
        super().__init__()
        self.num_experts = moe.num_experts
        self.intermediate = moe.moe_intermediate_size if intermediate is None else intermediate
        self.gate_up_proj = nn.Parameter(
            torch.empty(moe.num_experts, 2 * self.intermediate, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, self.intermediate))

    def forward(
        self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of each token's experts.

        Args:
            hidden: ``[T, hidden]``.
            experts: ``[T, k]`` int64 expert ids per token.
            weights: ``[T, k]`` routing weights, in ``hidden``'s dtype.

        Returns:
            ``[T, hidden]``.
        """
        tokens, top_k = experts.shape
        pair_experts = experts.reshape(-1)
        order = torch.argsort(pair_experts, stable=True)
        rows = hidden.index_select(0, order // top_k)
        counts = torch.bincount(pair_experts, minlength=self.num_experts).tolist()
        sorted_out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            stop = start + count
            gate_up = F.linear(rows[start:stop], self.gate_up_proj[expert])
            sorted_out[start:stop] = F.linear(self.activation(gate_up), self.down_proj[expert])
            start = stop
        pair_out = torch.empty_like(sorted_out)
        pair_out[order] = sorted_out
        weighted = pair_out.view(tokens, top_k, -1) * weights[..., None]
        return weighted.sum(dim=1)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of one expert's merged product ``[count, 2 * intermediate]``
        (its gate rows first, as ``gate_up_proj`` holds them)."""
        return swiglu(gate_up)


class Qwen3MoeSparseBlock(nn.Module):
    """Router (``gate``) and experts; parameter names follow the Hugging Face checkpoint.

    Tensor-parallel, the router is replicated (every rank routes the same, identical hidden
    states to the same experts) and the experts' partial sums are all-reduced once.

    Args:
        hidden_size: residual width.
        moe: the MoE configuration.
        intermediate: rows of each expert's hidden layer held (default: all).
        collectives: the rank's group (none: a group of one).
    """

    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        intermediate: int | None = None,
        collectives: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Qwen3MoeExperts(hidden_size, moe, intermediate)
        self.collectives: Collectives = collectives or SingleRank()

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert ids [T, k], routing weights [T, k] in hidden's dtype)``."""
        logits = self.gate(hidden)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return experts, top.to(logits.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: ``[T, hidden_size]``; returns the same shape."""
        experts, weights = self.route(hidden)
        out: torch.Tensor = self.experts(hidden, experts, weights)
        return self.collectives.all_reduce(out)
