"""Which of oneDNN's packed weight layouts a packed tensor is in, checked byte for byte.

oneDNN's packed tensors are opaque to torch: it picks their blocked layout itself, by dtype,
shape and CPU. :func:`read_layout` names the layout of one only after rebuilding the expected
bytes from the plain weight and finding them equal to oneDNN's, so a kernel that reads packed
weights itself (:mod:`pagedkv.accel.cpu.packed_gemv`) never reads a layout it was not written for:
a weight in any other layout, or where torch does not expose the bytes, stays with oneDNN.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812


@dataclass(frozen=True, slots=True)
class BlockedLayout:
    """A weight ``[out, in]`` in blocks of ``block_out`` outputs by ``block_in`` inputs, output
    blocks outermost, both dimensions padded with zeros to whole blocks; inside a block, for
    each group of ``pair`` consecutive inputs, the block's outputs' ``pair`` weights side by
    side.

    Attributes:
        dtype: the weight's dtype.
        block_out: outputs per block.
        block_in: inputs per block.
        pair: consecutive inputs stored together (2: the pairs a bfloat16 dot product reads).
        name: oneDNN's name of the layout.
    """

    dtype: torch.dtype
    block_out: int
    block_in: int
    pair: int
    name: str

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[out, in]`` laid out in this layout: a new contiguous tensor of the
        padded size."""
        out_features, in_features = weight.shape
        pad_out = -out_features % self.block_out
        pad_in = -in_features % self.block_in
        padded = F.pad(weight.detach(), (0, pad_in, 0, pad_out))
        blocks = padded.reshape(
            (out_features + pad_out) // self.block_out,
            self.block_out,
            (in_features + pad_in) // self.block_in,
            self.block_in // self.pair,
            self.pair,
        )
        return blocks.permute(0, 2, 3, 1, 4).contiguous()


#: The layouts oneDNN packs float32 and bfloat16 weights in for AVX-512 kernels (products of
#: many rows), and the only ones :mod:`pagedkv.accel.cpu.packed_gemv` reads: bfloat16 in 32-output
#: blocks where the CPU has AMX, in 64-output blocks where it has a bfloat16 dot product but
#: no AMX (as AMD's Zen 4).
LAYOUTS = (
    BlockedLayout(torch.float32, 64, 16, 1, "AB16b64a"),
    BlockedLayout(torch.bfloat16, 32, 32, 2, "AB16b32a2b"),
    BlockedLayout(torch.bfloat16, 64, 32, 2, "AB16b64a2b"),
)

#: The bfloat16 layout the AMX kernel reads.
AMX_LAYOUT = LAYOUTS[1]


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A packed weight whose layout is known.

    Attributes:
        layout: its layout.
        address: the address of its first byte, valid while the packed tensor lives.
    """

    layout: BlockedLayout
    address: int


def packed_bytes(packed: torch.Tensor) -> torch.Tensor | None:
    """The bytes of the oneDNN tensor ``packed`` as a ``uint8`` view of its memory (valid
    while ``packed`` lives), or ``None`` where torch does not expose them."""
    try:
        address = int(torch.ops.mkldnn.data_ptr(packed))
        size = int(torch.ops.mkldnn._nbytes(packed))
    except (AttributeError, RuntimeError):
        return None
    if address == 0 or size == 0:
        return None
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)


def read_layout(weight: torch.Tensor, packed: torch.Tensor) -> PackedWeight | None:
    """The layout of ``packed``, oneDNN's packing of the plain ``weight`` ``[out, in]``: the
    one of :data:`LAYOUTS` whose packing of ``weight`` equals ``packed`` byte for byte
    (padding included), or ``None`` if none does."""
    found = packed_bytes(packed)
    if found is None:
        return None
    for layout in LAYOUTS:
        if layout.dtype != weight.dtype:
            continue
        expected = layout.pack(weight).view(torch.uint8).reshape(-1)
        if expected.numel() == found.numel() and torch.equal(expected, found):
            return PackedWeight(layout, found.data_ptr())
    return None
