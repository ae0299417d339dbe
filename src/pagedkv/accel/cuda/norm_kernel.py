"""RMSNorm as Triton kernels: fused with the residual add before it (ENG-221), or with the RoPE
rotation after it for a query or key norm (ENG-222), one launch for every row of a step.

Why: in torch, one RMSNorm is about ten operators (a cast, a square, a mean, an add, a
reciprocal square root, two products, ...) and a rotation seven more; a Qwen3 layer runs two
residual adds, four norms and two rotations, so a decode step pays about fifty kernel launches
per layer for a few kilobytes of arithmetic. Here a layer's norms are four launches.

Each program holds one row (a norm's ``dim`` channels, or one head's ``head_dim``) in a block of
the next power of two, masked past the row: Qwen3's rows (at most a few thousand channels) fit
one block, and a row read once is normalised from registers. Sums of squares accumulate in
float32. Every rounding the reference modules make is made here too, in the same place: the
residual sum rounded to the dtype (and that rounded row normalised), the normalised row
rounded before the weight multiplies, and each of the rotation's two products and their sum
rounded, so a 16-bit result on a GPU differs from the reference only where the sum of
squares' order of terms moves a last bit. Under Triton's interpreter a float32 value cast to
bfloat16 is truncated, not rounded (PST-047): there bfloat16 results are off by a bfloat16
rounding, which the tests allow; the GPU's own 16-bit path is held by the golden suites run
there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.accel.cuda.kernel_shapes import block_of

#: The widest row a program holds in its block: wider rows stay with the reference module.
MAX_CHANNELS = 65536


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    residual_ptr,
    total_ptr,
    out_ptr,
    weight_ptr,
    stride_x,
    stride_residual,
    stride_total,
    stride_out,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum rounded to the dtype, written, and normalised as rounded
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(total_ptr + row * stride_total + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean = tl.sum(x32 * x32, axis=0) / dim
    normed = (x32 * tl.rsqrt(mean + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_rope_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_row,
    stride_x_head,
    stride_out_row,
    stride_out_head,
    stride_cos,
    stride_sin,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    mask = dims < HEAD_DIM
    half = HEAD_DIM // 2
    # Rotate half: channel i pairs with i + half. The partner row is read a second time from
    # memory (a block cannot be permuted in registers) and normalised by the same factor.
    first = dims < half
    partner = tl.where(first, dims + half, dims - half)
    dtype = out_ptr.dtype.element_ty
    row = x_ptr + token * stride_x_row + head * stride_x_head
    x = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    weight = tl.load(weight_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    weight_partner = tl.load(weight_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    normed = (weight * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    normed_partner = (weight_partner * (x_partner * scale).to(dtype).to(tl.float32)).to(dtype)
    rotated = tl.where(first, -normed_partner.to(tl.float32), normed_partner.to(tl.float32))
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=mask, other=0.0).to(tl.float32)
    straight = (normed * cos).to(dtype).to(tl.float32)
    turned = (rotated * sin).to(dtype).to(tl.float32)
    out = (straight + turned).to(dtype)
    tl.store(out_ptr + token * stride_out_row + head * stride_out_head + dims, out, mask=mask)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` with ``s = x + residual`` rounded to ``x``'s dtype (``s`` is ``x``
    itself when ``residual`` is ``None``), each ``[..., dim]`` like ``x``.

    Preconditions (:class:`~pagedkv.accel.cuda.fused_modules.TritonRMSNorm` checks them):
    ``x``, ``residual`` and ``weight`` ``[dim]`` of one dtype on the kernels' device, ``dim``
    at most :data:`MAX_CHANNELS`, ``residual`` of ``x``'s shape. No host synchronisation.
    """
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        added, total = rows, x
    else:
        added = residual.reshape(-1, dim)
        added = added if added.stride(-1) == 1 else added.contiguous()
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        # Without a residual nothing is written to the sum: the output stands in for it.
        total_rows = out if residual is None else total.view(-1, dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            added,
            total_rows,
            out,
            weight,
            rows.stride(0),
            added.stride(0),
            total_rows.stride(0),
            out.stride(0),
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block_of(dim, 1),
        )
    return total, out.view(x.shape)


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """Each head of ``x`` ``[T, heads, head_dim]`` normalised by ``weight`` ``[head_dim]``, then
    rotated by the tables ``cos`` and ``sin`` ``[T, head_dim]``: a new contiguous
    ``[T, heads, head_dim]``. ``x`` may be a view of a wider product (the q part of the merged
    qkv one): its channels must be contiguous, its heads and rows any distance apart.

    Preconditions (:class:`~pagedkv.accel.cuda.fused_modules.TritonRMSNorm` checks them): every
    tensor of one dtype on the kernels' device, ``head_dim`` even. No host synchronisation.
    """
    tokens, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if tokens and heads:
        _rms_norm_rope_kernel[(tokens, heads)](
            x,
            out,
            weight,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            sin.stride(0),
            eps,
            HEAD_DIM=head_dim,
            BLOCK_D=block_of(head_dim, 1),
        )
    return out
