"""The SwiGLU activation ``silu(gate) * up`` as a Triton kernel (ENG-223): one launch for every
row of a step, reading the merged gate/up product in place.

Why: in torch the activation is a split of the merged product into two views, a silu and a
product, each a kernel launch with its own output; here it is one launch and one output.

A program takes one row and :data:`BLOCK` columns of it (a grid ``(rows, blocks)``, the last
block masked past the row's ``width``), so an MLP of any width runs with one compiled kernel
per dtype. silu is computed in float32 as ``g / (1 + exp(-g))`` and rounded to the dtype
before ``up`` multiplies, where torch rounds it; the product is rounded once. Under Triton's
interpreter a float32 value cast to bfloat16 is truncated (PST-047): see
:mod:`pagedkv.accel.cuda.norm_kernel`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.accel.cuda.kernel_shapes import block_of

#: Columns per program (the last block of a row masked past its width).
BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]
def _swiglu_kernel(  # type: ignore[no-untyped-def]
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    at = gate_up_ptr + row * stride_in + cols
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + width, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    out = (silu.to(tl.float32) * up).to(dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def swiglu(gate_up: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[T, 2 * width]`` (gate the first ``width`` columns
    of each row, up the rest): a new contiguous ``[T, width]``, computed by programs of
    ``block`` columns (a power of two; the tests cut small rows into several blocks).

    Preconditions (:class:`~pagedkv.accel.cuda.fused_modules.TritonSwiGLUMLP` checks them):
    on the kernels' device, each row contiguous (rows any distance apart), an even number of
    columns. No host synchronisation.
    """
    rows, columns = gate_up.shape
    width = columns // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows and width:
        block = min(block, block_of(width, 1))
        _swiglu_kernel[(rows, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block
        )
    return out
