"""What one rank of a tensor-parallel group holds of a Qwen3 model, and the collectives its
layers call (specs/tensor-parallel.md).

:class:`ShardLayout` is the arithmetic of the split, torch-free: rank ``r`` of ``N`` holds the
``r``-th block of the query heads, of the MLP's hidden layer and of each expert's, a block of
``ceil(V / N)`` vocabulary rows, and its K/V heads (split, or one replicated head when the model
has fewer K/V heads than ranks, as vLLM's ``QKVParallelLinear`` does).

:class:`Collectives` is what the row-parallel layers, the vocabulary-parallel embedding and the
LM head call. :class:`SingleRank` is the identity, so the same model classes run unsplit at
``N = 1`` with no communication and the numerics of the plain model. The process-group
implementation is in :mod:`pagedkv.parallel.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagedkv.errors import InvalidRequest, UnsupportedModel
from pagedkv.model.config import ModelConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Rank ``rank`` of ``size``: the blocks of a model it holds.

    Attributes:
        rank: this rank, ``0 <= rank < size``.
        size: ranks in the group (``tensor_parallel_size``).
        num_heads: query heads held (``num_attention_heads / size``).
        num_kv_heads: K/V heads held.
        kv_head_start: the first K/V head held (of the unsplit model).
        intermediate: rows of the dense MLP's hidden layer held.
        moe_intermediate: rows of each expert's hidden layer held; 0 for a dense model.
        vocab_rows: vocabulary rows of the embedding and LM head held, ``ceil(V / size)``,
            the last rank's block padded past ``V``.
        vocab_start: the first vocabulary id held.
        vocab_stop: one past the last real vocabulary id held (``<= vocab_size``).
    """

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate: int
    moe_intermediate: int
    vocab_rows: int
    vocab_start: int
    vocab_stop: int

    @property
    def is_first(self) -> bool:
        """Rank 0: the one that adds row-parallel biases and receives the logits."""
        return self.rank == 0

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> ShardLayout:
        """The blocks rank ``rank`` of ``size`` holds of a model shaped by ``config``.

        Raises:
            InvalidRequest: ``size < 1`` or ``rank`` outside ``0..size-1``.
            UnsupportedModel: a dimension that ``size`` ranks cannot split (TP-003), naming
                the field and the size.
        """
        if size < 1:
            raise InvalidRequest(f"tensor_parallel_size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise InvalidRequest(f"rank {rank} is outside a group of {size}")
        heads = _split(config.num_attention_heads, size, "num_attention_heads")
        kv = config.num_key_value_heads
        if kv >= size:
            kv_heads = _split(kv, size, "num_key_value_heads")
            kv_start = rank * kv_heads
        else:
            if size % kv != 0:
                raise UnsupportedModel(
                    f"num_key_value_heads={kv} neither divides by nor divides "
                    f"tensor_parallel_size={size}"
                )
            kv_heads, kv_start = 1, rank // (size // kv)
        intermediate = _split(config.intermediate_size, size, "intermediate_size")
        moe = 0
        if config.moe is not None:
            moe = _split(config.moe.moe_intermediate_size, size, "moe_intermediate_size")
        rows = -(-config.vocab_size // size)
        start = min(rank * rows, config.vocab_size)
        return cls(
            rank=rank,
            size=size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            kv_head_start=kv_start,
            intermediate=intermediate,
            moe_intermediate=moe,
            vocab_rows=rows,
            vocab_start=start,
            vocab_stop=min(start + rows, config.vocab_size),
        )


def _split(total: int, size: int, name: str) -> int:
    if total % size != 0:
        raise UnsupportedModel(f"{name}={total} is not divisible by tensor_parallel_size={size}")
    return total // size


class Collectives(Protocol):
    """The communication of one rank's model shard with the others of its group.

    Every rank calls each method in the same order with tensors of the same shape; rank 0 of
    the group is the one of :attr:`ShardLayout.is_first`.
    """

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``tensor`` over the ranks (every rank gets the same)."""
        ...

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """On rank 0, the ranks' ``[R, C]`` tensors side by side (``[R, size * C]``, rank
        order); ``None`` on the others."""
        ...


class SingleRank:
    """The collectives of a group of one: the sum and the gather of a tensor are itself."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor
