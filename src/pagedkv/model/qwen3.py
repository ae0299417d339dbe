"""The Qwen3 (dense and MoE) decoder-only language model, run one
:class:`~pagedkv.plan.StepPlan` at a time.

The module tree mirrors the Hugging Face checkpoint, so parameter names match its tensor names
(``model.layers.3.input_layernorm.weight``, ``lm_head.weight``, ...), except the merged
projections: ``self_attn.qkv_proj`` (stored as ``q_proj``, ``k_proj``, ``v_proj``) and
``mlp.gate_up_proj`` (``gate_proj``, ``up_proj``), which the loader fills part by part
(:mod:`pagedkv.model.checkpoint_layout`). The model reads nothing but the plan and the step's
attention: it keeps no per-sequence state between steps.

Built with a :class:`~pagedkv.model.tensor_parallel.ShardLayout` and its collectives, the
model is one rank's shard of a tensor-parallel group (specs/tensor-parallel.md): the
embedding and the LM head are split by vocabulary rows, attention by heads, the MLP by its
hidden layer; every rank runs the same plan and rank 0 receives the logits.
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
from pagedkv.model.tensor_parallel import Collectives, ShardLayout, SingleRank
from pagedkv.plan import StepPlan


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h += attn(norm(h)); h += mlp(norm(h))``.

    The residual stream is passed as two terms, as vLLM passes it: a layer returns its MLP's
    output and the stream before it, and the next norm adds them in the same call that
    normalises the sum (:meth:`~pagedkv.model.layers.RMSNorm.add_forward`), so no layer
    spends a separate addition on it. The sum is rounded to the model's dtype as transformers
    rounds ``h + mlp(...)``.

    The MLP is the sparse MoE block on a Qwen3-MoE model's sparse layers
    (:meth:`~pagedkv.model.config.MoeConfig.is_sparse`), the dense SwiGLU MLP elsewhere.
    """

    def __init__(
        self, config: ModelConfig, layer: int, layout: ShardLayout, collectives: Collectives
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer, layout, collectives)
        self.mlp: nn.Module = (
            Qwen3MoeSparseBlock(
                config.hidden_size, config.moe, layout.moe_intermediate, collectives
            )
            if config.moe is not None and config.moe.is_sparse(layer)
            else SwiGLUMLP(config.hidden_size, layout.intermediate, collectives)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: StepAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` ``[T, hidden_size]``: the previous layer's output, which adds to
        ``residual`` (the stream before it); for the first layer the embeddings, with
        ``residual`` ``None``. Returns this layer's ``(output, residual)``, same shape."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            residual, normed = self.input_layernorm.add_forward(hidden, residual)
        attended = self.self_attn(normed, cos, sin, attention)
        residual, normed = self.post_attention_layernorm.add_forward(attended, residual)
        out: torch.Tensor = self.mlp(normed)
        return out, residual


class DecoderLayers(nn.ModuleList):
    """The decoder layers in order (the checkpoint's ``model.layers.N.*``), run as one stack."""

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: StepAttention
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer on the embeddings ``hidden`` ``[T, hidden_size]``, rotated by ``cos``
        and ``sin`` ``[T, head_dim]``: the last layer's ``(output, residual)``, whose sum is
        the stream (``residual`` is ``None`` for a model without layers)."""
        residual: torch.Tensor | None = None
        for layer in self:
            hidden, residual = layer(hidden, residual, cos, sin, attention)
        return hidden, residual


class VocabParallelEmbedding(nn.Module):
    """The embedding table, or one rank's block of its vocabulary rows.

    A rank looks up the ids it holds and gives zeros for the others; the all-reduce of those
    rows over the ranks is the whole lookup (exact: every sum has one non-zero term). In a
    group of one it is ``nn.Embedding``.

    Attributes:
        weight: ``[layout.vocab_rows, hidden]``; rows past ``vocab_stop - vocab_start`` pad
            the last rank's block and are never looked up.
    """

    def __init__(self, hidden_size: int, layout: ShardLayout, collectives: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_rows, hidden_size))
        self.layout = layout
        self.collectives = collectives

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: ``[T]`` int64 vocabulary ids; returns ``[T, hidden]``."""
        if self.layout.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.layout.vocab_start
        held = (local >= 0) & (ids < self.layout.vocab_stop)
        rows = F.embedding(torch.where(held, local, 0), self.weight)
        return self.collectives.all_reduce(rows * held[:, None].to(rows.dtype))


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and the final norm (the checkpoint's ``model.*`` tensors)."""

    def __init__(self, config: ModelConfig, layout: ShardLayout, collectives: Collectives) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.hidden_size, layout, collectives)
        self.layers = DecoderLayers(
            [
                Qwen3DecoderLayer(config, i, layout, collectives)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with its LM head; the LM head is the embedding table when embeddings are tied.

    Build it with :func:`pagedkv.model.loader.load_model`; a freshly constructed one holds
    untrained parameters. Run it under ``torch.inference_mode()`` (or ``no_grad``).

    Args:
        config: the model configuration.
        layout: the blocks this rank holds (default: the whole model, a group of one).
        collectives: the rank's group, called by every rank in the same order (default: a
            group of one).
    """

    def __init__(
        self,
        config: ModelConfig,
        layout: ShardLayout | None = None,
        collectives: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layout = layout or ShardLayout.of(config)
        self.collectives: Collectives = collectives or SingleRank()
        self.model = Qwen3Model(config, self.layout, self.collectives)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        #: The LM head, or ``None`` when the embeddings are tied: the embedding table is then
        #: the head's weight (an acceleration may place a head of its own here).
        self.lm_head: Linear | None = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, self.layout.vocab_rows, bias=False)
        )

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
            ``plan.logits_indices`` (by default each sequence's last row). On a rank other
            than rank 0 of a tensor-parallel group, ``[len(plan.logits_indices), 0]``: the
            logits are gathered on rank 0 only.
        """
        hidden = self.model.embed_tokens(plan.input_ids)
        cos, sin = self.rotary(plan.positions, hidden.dtype)
        hidden, residual = self.model.layers(hidden, cos, sin, attention)
        rows = plan.logits_indices
        if residual is None:
            hidden = self.model.norm(hidden.index_select(0, rows))
        else:
            _, hidden = self.model.norm.add_forward(
                hidden.index_select(0, rows), residual.index_select(0, rows)
            )
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(hidden).to(torch.float32)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight).to(torch.float32)
        if self.layout.size == 1:
            return logits
        gathered = self.collectives.gather_columns(logits)
        if gathered is None:
            return logits[:, :0]
        return gathered[:, : self.config.vocab_size]
