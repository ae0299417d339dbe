"""Tile sizes of the Triton attention kernels: host arithmetic, no torch, no triton.

``tl.dot`` needs every dimension of its tiles to be a power of two and at least 16 on a GPU;
the kernels mask what lies past the real sizes, so a tile is the real size rounded up.
"""

from __future__ import annotations

#: Smallest tile dimension ``tl.dot`` takes on a GPU.
DOT_MIN = 16
#: Most splits of a decoding context (vLLM's Triton backend splits into a fixed 8 or 16).
MAX_DECODE_SPLITS = 8
#: Context positions per tile of the decode kernel.
DECODE_BLOCK_N = 32


def block_of(size: int, least: int = DOT_MIN) -> int:
    """``size`` rounded up to a power of two, at least ``least`` (``size >= 1``)."""
    block = least
    while block < size:
        block *= 2
    return block


def decode_splits(longest: int) -> int:
    """Splits of every decoding context of a step whose longest is ``longest`` positions: the
    smallest power of two, at most :data:`MAX_DECODE_SPLITS`, whose splits of one tile
    (:data:`DECODE_BLOCK_N` positions) each cover ``longest``: no split of the longest context
    is empty, and a short step is not cut into programs that read nothing. The kernel gives
    each split of a context its even share rounded up to whole tiles, so a shorter context's
    last splits may be empty. A power of two, since the merge reads the splits as one tile;
    few values, so few compiled variants of the kernel."""
    splits = 1
    while splits < MAX_DECODE_SPLITS and splits * DECODE_BLOCK_N < longest:
        splits *= 2
    return splits
