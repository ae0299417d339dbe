"""RMSNorm in one call: fused with the residual add before it, or with the RoPE rotation after
it, as a small C kernel (``native/fused_norms.c``) built on first use by
:mod:`pagedkv.native.build`.

Why: written in torch, one RMSNorm is about ten operators (a cast, a square, a mean, an add, a
reciprocal square root, two products, ...) and a rotation seven more; a Qwen3 layer runs four
norms, two rotations and two residual adds, so a decode step of a few rows pays about fifty
operator dispatches per layer for a few kilobytes of arithmetic (``bench/kernels.md`` has the
figures).

The kernel repeats transformers' arithmetic operation by operation, with the same roundings
(the C file says which), so it differs from the torch formulation only in the order of the
terms of the mean of squares: float32 outputs agree to a few units in the last place
(ENG-116). Inside ``torch.compile`` the torch formulation runs instead (inductor fuses it into
the step), and so it does for a dtype or device the kernel was not built for.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedkv.accel.substitution import as_subclass
from pagedkv.model.layers import RMSNorm, apply_rotary
from pagedkv.native.build import BuildFailure, entry_address, load_library

#: The kernel's C source, shipped with the package.
SOURCE = Path(__file__).with_name("native") / "fused_norms.c"

#: No fused multiply-add: every product is rounded before it is summed, as torch rounds it.
#: Loops vectorized 16 lanes wide where the CPU has AVX-512 (gcc's default for such a CPU is
#: 8): 15% faster on the 0.6B shape's 512-token rows.
EXTRA_FLAGS = ("-ffp-contract=off", "-mprefer-vector-width=512")

#: The widest row the C file's buffers hold: a norm's channels, and a rotated head's.
MAX_CHANNELS = 16384
MAX_HEAD_DIM = 1024

#: Dtypes the kernel computes in: the entry points' first argument for each.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

#: The entry points' argument types: dtype code, five pointers, sizes, eps, threads.
_INT, _POINTER, _SIZE, _FLOAT = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ADD_RMS_NORM: list[Any] = [_INT, *[_POINTER] * 5, _SIZE, _SIZE, _FLOAT, _INT]
_RMS_NORM_ROPE: list[Any] = [_INT, *[_POINTER] * 5, *[_SIZE] * 4, _FLOAT, _INT]


class FusedNorms:
    """The kernel for one dtype on the CPU. Build it with :meth:`build`; a call is made only
    for inputs :meth:`takes`, :meth:`takes_sum` or :meth:`takes_rotation` accepts
    (:class:`FusedRMSNorm` asks first), others stay with torch."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._add_rms_norm = library.add_rms_norm
        self._add_rms_norm.argtypes = _ADD_RMS_NORM
        self._add_rms_norm.restype = ctypes.c_int
        self._rms_norm_rope = library.rms_norm_rope
        self._rms_norm_rope.argtypes = _RMS_NORM_ROPE
        self._rms_norm_rope.restype = ctypes.c_int
        self.dtype = dtype
        self._code = DTYPE_CODES[dtype]

    @property
    def addresses(self) -> tuple[int, int]:
        """The entry points ``add_rms_norm`` and ``rms_norm_rope``, for C code that calls them
        (``decode_layers.c``)."""
        return entry_address(self._add_rms_norm), entry_address(self._rms_norm_rope)

    @classmethod
    def build(cls, dtype: torch.dtype, folder: Path | None = None) -> FusedNorms | BuildFailure:
        """The kernel for ``dtype``, built if needed; the reason it cannot be."""
        if dtype not in DTYPE_CODES:
            return BuildFailure(f"the fused norms compute in float32 and bfloat16, not {dtype}")
        library = load_library(SOURCE, folder, EXTRA_FLAGS)
        return library if isinstance(library, BuildFailure) else cls(library, dtype)

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this kernel computes the norm of ``x`` by ``weight``: both of its dtype on
        the CPU, rows contiguous and at most :data:`MAX_CHANNELS` wide, and not inside
        ``torch.compile``."""
        return (
            x.shape[-1] <= MAX_CHANNELS
            and x.dtype == self.dtype
            and weight.dtype == self.dtype
            and x.device.type == "cpu"
            and x.stride(-1) == 1
            and not torch.compiler.is_compiling()
        )

    def takes_sum(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """:meth:`takes`, and ``residual`` of ``x``'s dtype and shape."""
        same = (residual.dtype, residual.shape) == (x.dtype, x.shape)
        return same and self.takes(x, weight)

    def takes_rotation(
        self, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> bool:
        """:meth:`takes` for ``x`` ``[T, heads, dim]``, ``dim`` at most :data:`MAX_HEAD_DIM`,
        and tables of one ``dim``-wide row per token."""
        tokens, _, dim = x.shape
        fits = dim <= MAX_HEAD_DIM and cos.shape == sin.shape == (tokens, dim)
        return fits and self.takes(x, weight)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, norm(s))`` with ``s = x + residual`` (``s = x`` when ``residual`` is
        ``None``); ``x`` and ``residual`` ``[..., dim]`` of the same shape."""
        # Every tensor whose pointer the kernel reads is held by a name until it returns.
        x, weight = x.contiguous(), weight.contiguous()
        residual = None if residual is None else residual.contiguous()
        dim = x.shape[-1]
        total = x if residual is None else torch.empty_like(x)
        out = torch.empty_like(x)
        failed = self._add_rms_norm(
            self._code,
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            total.data_ptr(),
            out.data_ptr(),
            weight.data_ptr(),
            x.numel() // dim,
            dim,
            eps,
            torch.get_num_threads(),
        )
        if failed:
            raise ValueError(f"the fused norm takes rows of at most {MAX_CHANNELS}, not {dim}")
        return total, out

    def rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """Each head of ``x`` ``[T, heads, dim]`` normalised, then rotated by the tables
        ``[T, dim]``; a new contiguous ``[T, heads, dim]``. ``x`` may be a view of a wider
        product: its heads must lie ``dim`` apart, its rows any distance."""
        tokens, heads, dim = x.shape
        if x.stride(1) != dim:
            x = x.contiguous()
        # Every tensor whose pointer the kernel reads is held by a name until it returns.
        weight = weight.contiguous()
        cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
        out = torch.empty(tokens, heads, dim, dtype=x.dtype)
        failed = self._rms_norm_rope(
            self._code,
            x.data_ptr(),
            out.data_ptr(),
            weight.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            heads,
            dim,
            x.stride(0),
            eps,
            torch.get_num_threads(),
        )
        if failed:
            raise ValueError(f"the fused rotation takes heads of at most {MAX_HEAD_DIM}, not {dim}")
        return out


class FusedRMSNorm(RMSNorm):
    """A :class:`~pagedkv.model.layers.RMSNorm` that normalises in one kernel call, with the
    residual add before it (:meth:`add_forward`) or the rotation after it (:meth:`rotated`),
    for inputs the kernel takes; the reference formulation for others. Build it with
    :meth:`substitute`."""

    kernel: FusedNorms

    @classmethod
    def substitute(cls, norm: RMSNorm, kernel: FusedNorms) -> FusedRMSNorm:
        """``norm``'s substitute (its weight shared), ``norm`` not changed."""
        return as_subclass(norm, cls, kernel=kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]``; returns the same shape and dtype."""
        if self.kernel.takes(x, self.weight):
            return self.kernel.add_rms_norm(x, None, self.weight, self.eps)[1]
        return super().forward(x)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``, ``x`` and ``residual`` of one shape."""
        if self.kernel.takes_sum(x, residual, self.weight):
            return self.kernel.add_rms_norm(x, residual, self.weight, self.eps)
        return super().add_forward(x, residual)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rotary(norm(x), cos, sin)`` of ``x`` ``[T, heads, dim]``."""
        if self.kernel.takes_rotation(x, self.weight, cos, sin):
            return self.kernel.rms_norm_rope(x, self.weight, cos, sin, self.eps)
        return apply_rotary(self(x), cos, sin)


def has_fused_norms(model: nn.Module) -> bool:
    """Whether any RMSNorm of ``model`` is a :class:`FusedRMSNorm`."""
    return any(isinstance(m, FusedRMSNorm) for m in model.modules())
