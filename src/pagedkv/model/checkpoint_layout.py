"""Which checkpoint tensor fills which part of which model parameter: the loader's one table of
names.

Most parameters are stored under their own name, whole. Merged projections
(:class:`~pagedkv.model.layers.MergedLinear`: ``self_attn.qkv_proj``, ``mlp.gate_up_proj``) are
stored as their parts, each filling its rows in order: ``self_attn.q_proj.weight`` rows
``0..q``, ``k_proj`` the next ``kv``, ``v_proj`` the last (biases alike); ``mlp.gate_proj`` then
``mlp.up_proj``. A checkpoint that stores the merged tensor under the model's own name loads it
whole. A Qwen3-MoE model's experts are
stacked in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``)
but stored either

* per expert, as released checkpoints and transformers' ``save_pretrained`` write them:
  ``mlp.experts.{e}.gate_proj.weight [I, H]`` (rows ``0..I`` of expert ``e``'s
  ``gate_up_proj``), ``mlp.experts.{e}.up_proj.weight [I, H]`` (rows ``I..2I``),
  ``mlp.experts.{e}.down_proj.weight [H, I]``; or
* stacked, under the in-memory names, as some conversion tools write them.

A layer's experts are read per expert unless its stacked tensor is present.

A rank of a tensor-parallel group reads only its blocks of the split tensors
(:func:`shard_pieces`, specs/tensor-parallel.md). torch-free.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pagedkv.errors import UnsupportedModel
from pagedkv.model.config import ModelConfig
from pagedkv.model.tensor_parallel import ShardLayout

#: Suffixes of the stacked expert parameters.
GATE_UP = ".mlp.experts.gate_up_proj"
DOWN = ".mlp.experts.down_proj"

#: An index into a parameter: all of it, an expert, a row range, an expert and a row range,
#: or (a rank's stacked experts) every expert and a row range.
Index = tuple[()] | tuple[int] | tuple[slice] | tuple[int, slice] | tuple[slice, slice]

#: A merged projection's parts: module name (``model.layers.0.self_attn.qkv_proj``) to the
#: ``(part name, rows)`` of each part, in row order.
MergedParts = Mapping[str, Sequence[tuple[str, int]]]


@dataclass(frozen=True, slots=True)
class TensorPiece:
    """One checkpoint tensor and where it is copied.

    Attributes:
        tensor: the checkpoint tensor's name.
        param: the model parameter's name.
        index: where in the parameter (``()`` for all of it).
        shape: the shape the checkpoint tensor must have.
    """

    tensor: str
    param: str
    index: Index
    shape: tuple[int, ...]


def checkpoint_pieces(
    params: Mapping[str, tuple[int, ...]],
    stored: Collection[str],
    merged: MergedParts | None = None,
) -> list[TensorPiece]:
    """Every checkpoint tensor the model reads, in parameter order.

    Args:
        params: the model's parameter names and shapes.
        stored: the names of the tensors the checkpoint holds (to tell its expert layout).
        merged: the model's merged projections and their parts.
    """
    pieces: list[TensorPiece] = []
    merged = merged or {}
    for name, shape in params.items():
        module, _, kind = name.rpartition(".")
        if name not in stored and module in merged:
            pieces.extend(_merged_pieces(name, module, kind, shape, merged[module]))
            continue
        if name in stored or not name.endswith((GATE_UP, DOWN)):
            pieces.append(TensorPiece(name, name, (), shape))
            continue
        prefix = name.rsplit(".", 1)[0]
        experts, rows, cols = shape
        for e in range(experts):
            if name.endswith(DOWN):
                pieces.append(
                    TensorPiece(f"{prefix}.{e}.down_proj.weight", name, (e,), (rows, cols))
                )
                continue
            half = rows // 2
            for part, span in (("gate_proj", slice(0, half)), ("up_proj", slice(half, rows))):
                piece = TensorPiece(f"{prefix}.{e}.{part}.weight", name, (e, span), (half, cols))
                pieces.append(piece)
    return pieces


def _merged_pieces(
    name: str, module: str, kind: str, shape: tuple[int, ...], parts: Sequence[tuple[str, int]]
) -> list[TensorPiece]:
    """The part tensors of a merged projection's ``weight`` or ``bias``, row range by range."""
    parent = module.rpartition(".")[0]
    pieces = []
    start = 0
    for part, rows in parts:
        span = slice(start, start + rows)
        pieces.append(TensorPiece(f"{parent}.{part}.{kind}", name, (span,), (rows, *shape[1:])))
        start += rows
    return pieces


@dataclass(frozen=True, slots=True)
class ShardedPiece:
    """One checkpoint tensor, or the block of it one tensor-parallel rank reads, and where it
    is copied.

    Attributes:
        tensor: the checkpoint tensor's name.
        param: the rank's model parameter's name.
        index: where in that parameter (``()`` for all of it).
        source: the block of the checkpoint tensor to read, one slice per leading dimension
            (``()`` for all of it): what ``safe_open(...).get_slice(tensor)[source]`` reads.
        shape: the shape the whole checkpoint tensor must have.
    """

    tensor: str
    param: str
    index: Index
    source: tuple[slice, ...]
    shape: tuple[int, ...]


def shard_pieces(
    pieces: Sequence[TensorPiece], config: ModelConfig, layout: ShardLayout
) -> list[ShardedPiece]:
    """The blocks of the checkpoint tensors that rank ``layout.rank`` reads (TP-001, TP-004).

    ``pieces`` are the rank's own: from :func:`checkpoint_pieces` on the rank's parameter
    shapes and merged parts, so each piece's shape is the rank's block. Split tensors are read
    from the block the layout gives the rank; the others whole. In a group of one every piece
    reads its whole tensor.

    Raises:
        UnsupportedModel: a merged projection stored whole under the model's own name, which
            a rank cannot read as one block.
    """
    if layout.size == 1:
        return [ShardedPiece(p.tensor, p.param, p.index, (), p.shape) for p in pieces]
    sharded: list[ShardedPiece] = []
    for piece in pieces:
        sharded.extend(_shard(piece, config, layout))
    return sharded


def _shard(piece: TensorPiece, config: ModelConfig, layout: ShardLayout) -> list[ShardedPiece]:
    """One piece of a rank of several: which block of its tensor it reads."""
    name, shape = piece.tensor, piece.shape
    moe = config.moe.moe_intermediate_size if config.moe is not None else 0
    if name.endswith((".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight")):
        raise UnsupportedModel(
            f"tensor {name!r} stores a merged projection whole: tensor-parallel loading reads "
            "q/k/v and gate/up from their own tensors"
        )
    if name.endswith(GATE_UP):  # stacked experts: the rank's rows of gate, then of up
        rows = layout.moe_intermediate
        whole = (shape[0], 2 * moe, shape[2])
        every = slice(None)
        return [
            ShardedPiece(
                name,
                piece.param,
                (every, slice(half * rows, (half + 1) * rows)),
                (
                    every,
                    slice(half * moe + layout.rank * rows, half * moe + (layout.rank + 1) * rows),
                ),
                whole,
            )
            for half in (0, 1)
        ]
    split = _split_dim(name, config, layout, moe)
    if split is None:
        return [ShardedPiece(name, piece.param, piece.index, (), shape)]
    dim, start, full_size = split
    length = shape[dim]
    index = piece.index
    if name in (EMBED, HEAD):  # the last rank's block may be padded past the vocabulary
        length = layout.vocab_stop - layout.vocab_start
        index = (slice(0, length),)
    source = tuple(
        slice(start, start + length) if d == dim else slice(None) for d in range(dim + 1)
    )
    full = tuple(full_size if d == dim else n for d, n in enumerate(shape))
    return [ShardedPiece(name, piece.param, index, source, full)]


#: The vocabulary-parallel tensors.
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def _split_dim(
    name: str, config: ModelConfig, layout: ShardLayout, moe: int
) -> tuple[int, int, int] | None:
    """``(dimension, first index of the rank's block, whole size)`` of a split tensor, or
    ``None`` for a replicated one."""
    rank, head_dim = layout.rank, config.head_dim
    q_rows = layout.num_heads * head_dim
    expert = ".mlp.experts." in name
    if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_proj.bias")):
        return 0, rank * q_rows, config.q_size
    if name.endswith(
        (
            ".self_attn.k_proj.weight",
            ".self_attn.k_proj.bias",
            ".self_attn.v_proj.weight",
            ".self_attn.v_proj.bias",
        )
    ):
        return 0, layout.kv_head_start * head_dim, config.kv_size
    if name.endswith(".self_attn.o_proj.weight"):
        return 1, rank * q_rows, config.q_size
    if name.endswith(DOWN):  # stacked experts [E, H, I]
        return 2, rank * layout.moe_intermediate, moe
    if name.endswith((".gate_proj.weight", ".up_proj.weight")) and ".mlp." in name:
        rows = layout.moe_intermediate if expert else layout.intermediate
        return 0, rank * rows, moe if expert else config.intermediate_size
    if name.endswith(".down_proj.weight") and ".mlp." in name:
        cols = layout.moe_intermediate if expert else layout.intermediate
        return 1, rank * cols, moe if expert else config.intermediate_size
    if name in (EMBED, HEAD):
        return 0, layout.vocab_start, config.vocab_size
    return None
