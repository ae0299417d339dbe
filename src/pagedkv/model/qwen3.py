"""The Qwen3 (dense and MoE) decoder-only language model, run one
:class:`~pagedkv.plan.StepPlan` at a time.

The module tree mirrors the Hugging Face checkpoint, so parameter names match its tensor names
(``model.layers.3.input_layernorm.weight``, ``lm_head.weight``, ...), except the merged
projections: ``self_attn.qkv_proj`` (stored as ``q_proj``, ``k_proj``, ``v_proj``) and
``mlp.gate_up_proj`` (``gate_proj``, ``up_proj``), which the loader fills part by part
(:mod:`pagedkv.model.checkpoint_layout`). The model reads nothing but the plan and the step's
attention: it keeps no per-sequence state between steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pagedkv.model.attention import Qwen3Attention
from pagedkv.model.config import ModelConfig
from pagedkv.model.layers import Linear, RMSNorm, SwiGLUMLP
from pagedkv.model.moe import Qwen3MoeSparseBlock
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.model.step_attention import StepAttention
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
        attention: StepAttention,
    ) -> torch.Tensor:
        """``hidden``: ``[T, hidden_size]``; returns the same shape."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attention)
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
        self.lm_head: Linear | None = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        #: A repacked copy of the tied embedding table, as the LM head's weight
        #: (:func:`pagedkv.model.packing.pack_linear_weights`); ``None`` otherwise.
        self.packed_head: Linear | None = None

    if TYPE_CHECKING:  # nn.Module.__call__ is untyped; calling the model runs forward

        def __call__(self, plan: StepPlan, attention: StepAttention) -> torch.Tensor: ...

    def forward(self, plan: StepPlan, attention: StepAttention) -> torch.Tensor:
        """Run one step.

        Args:
            plan: the step's tokens and positions, on the model's device.
            attention: the step's attention, prepared from the same plan (by the runner):
                where this step's K/V go and what each sequence attends to.

        Returns:
            ``[len(plan.logits_indices), vocab_size]`` float32 logits of the rows
            ``plan.logits_indices`` (by default each sequence's last row).
        """
        hidden = self.model.embed_tokens(plan.input_ids)
        cos, sin = self.rotary(plan.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, attention)
        hidden = self.model.norm(hidden.index_select(0, plan.logits_indices))
        head = self.lm_head if self.lm_head is not None else self.packed_head
        if head is not None:
            logits: torch.Tensor = head(hidden)
            return logits.to(torch.float32)
        return F.linear(hidden, self.model.embed_tokens.weight).to(torch.float32)
