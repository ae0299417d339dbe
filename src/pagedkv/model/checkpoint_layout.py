"""Which checkpoint tensor fills which part of which model parameter.

Most parameters are stored under their own name, whole. A Qwen3-MoE model's experts are
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

from collections.abc import Collection, Mapping
from dataclasses import dataclass

#: Suffixes of the stacked expert parameters.
GATE_UP = ".mlp.experts.gate_up_proj"
DOWN = ".mlp.experts.down_proj"

#: An index into a parameter: an expert, or an expert and a row range.
Index = tuple[()] | tuple[int] | tuple[int, slice]


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
    params: Mapping[str, tuple[int, ...]], stored: Collection[str]
) -> list[TensorPiece]:
    """Every checkpoint tensor the model reads, in parameter order.

    Args:
        params: the model's parameter names and shapes.
        stored: the names of the tensors the checkpoint holds (to tell its expert layout).
    """
    pieces: list[TensorPiece] = []
    for name, shape in params.items():
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
