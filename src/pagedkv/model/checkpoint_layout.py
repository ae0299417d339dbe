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

A layer's experts are read per expert unless its stacked tensor is present. torch-free.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

#: Suffixes of the stacked expert parameters.
GATE_UP = ".mlp.experts.gate_up_proj"
DOWN = ".mlp.experts.down_proj"

#: An index into a parameter: all of it, an expert, a row range, or an expert and a row range.
Index = tuple[()] | tuple[int] | tuple[slice] | tuple[int, slice]

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
