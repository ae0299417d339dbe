"""The modules of ``fused_ops="triton"`` (ENG-220): RMSNorm, the dense SwiGLU MLP and the MoE
experts, their computations launched as this room's Triton kernels, and the rotary embedding
read from a table (ENG-232), substituted for the reference modules in a runner's copy of the
model (:mod:`pagedkv.accel.substitution`).

A call runs the kernel for inputs it takes (:func:`runs_on`: on the kernels' device, of one
dtype with the weight, rows contiguous, not inside ``torch.compile``) and the reference
formulation for others, as the CPU room's fused modules do.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.accel.cuda.norm_kernel import MAX_CHANNELS, rms_norm, rms_norm_rope
from pagedkv.accel.cuda.rotary_table import TableRotaryEmbedding
from pagedkv.accel.cuda.store_kernel import runs_interpreted
from pagedkv.accel.cuda.swiglu_kernel import swiglu
from pagedkv.accel.cuda.triton_substitute import TritonSubstitute
from pagedkv.accel.substitution import as_subclass
from pagedkv.model.layers import RMSNorm, SwiGLUMLP
from pagedkv.model.layers import swiglu as reference_swiglu
from pagedkv.model.moe import Qwen3MoeExperts
from pagedkv.model.rope import RotaryEmbedding

#: Dtypes the kernels compute in (each accumulating in float32).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_device() -> str:
    """The device type the kernels run on: the CPU under Triton's interpreter, else CUDA."""
    return "cpu" if runs_interpreted() else "cuda"


def runs_on(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the kernels take ``x`` (with ``weight``, of its dtype): on :func:`kernel_device`,
    of a dtype of :data:`DTYPES`, its last dimension contiguous, not inside ``torch.compile``."""
    return (
        x.dtype in DTYPES
        and (weight is None or weight.dtype == x.dtype)
        and x.device.type == kernel_device()
        and x.stride(-1) == 1
        and not torch.compiler.is_compiling()
    )


class TritonRMSNorm(RMSNorm, TritonSubstitute):
    """A :class:`~pagedkv.model.layers.RMSNorm` whose norm, residual add and rotation run as
    one Triton launch each (:mod:`pagedkv.accel.cuda.norm_kernel`). Build it with
    :meth:`substitute`."""

    @classmethod
    def substitute(cls, norm: RMSNorm) -> TritonRMSNorm:
        """``norm``'s substitute (its weight shared), ``norm`` not changed."""
        return as_subclass(norm, cls)

    def _takes(self, x: torch.Tensor) -> bool:
        return x.shape[-1] <= MAX_CHANNELS and runs_on(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]``; returns the same shape and dtype."""
        if self._takes(x):
            return rms_norm(x, None, self.weight, self.eps)[1]
        return super().forward(x)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``, ``x`` and ``residual`` of one shape."""
        same = (residual.dtype, residual.shape) == (x.dtype, x.shape)
        if same and self._takes(x) and residual.stride(-1) == 1:
            return rms_norm(x, residual, self.weight, self.eps)
        return super().add_forward(x, residual)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rotary(norm(x), cos, sin)`` of ``x`` ``[T, heads, dim]``, the tables
        ``[T, dim]``."""
        tokens, _, dim = x.shape
        tables = cos.shape == sin.shape == (tokens, dim) and cos.dtype == sin.dtype == x.dtype
        if tables and dim % 2 == 0 and self._takes(x):
            return rms_norm_rope(x, self.weight, cos, sin, self.eps)
        return super().rotated(x, cos, sin)


def fused_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged product ``gate_up`` ``[T, 2 * width]``: one Triton
    launch (:mod:`pagedkv.accel.cuda.swiglu_kernel`) reading it in place where the kernel
    takes it, else the reference function."""
    if gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and runs_on(gate_up):
        return swiglu(gate_up)
    return reference_swiglu(gate_up)


class TritonSwiGLUMLP(SwiGLUMLP, TritonSubstitute):
    """A :class:`~pagedkv.model.layers.SwiGLUMLP` whose activation is :func:`fused_swiglu`.
    Build it with :meth:`substitute`."""

    @classmethod
    def substitute(cls, mlp: SwiGLUMLP) -> TritonSwiGLUMLP:
        """``mlp``'s substitute (its projections shared), ``mlp`` not changed."""
        return as_subclass(mlp, cls)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the merged product ``gate_up`` ``[T, 2 * intermediate]``."""
        return fused_swiglu(gate_up)


class TritonMoeExperts(Qwen3MoeExperts, TritonSubstitute):
    """:class:`~pagedkv.model.moe.Qwen3MoeExperts` whose every expert's activation is
    :func:`fused_swiglu` (ENG-233). Build it with :meth:`substitute`."""

    @classmethod
    def substitute(cls, experts: Qwen3MoeExperts) -> TritonMoeExperts:
        """``experts``' substitute (their stacked weights shared), ``experts`` not changed."""
        return as_subclass(experts, cls)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of one expert's merged product ``[count, 2 * intermediate]``."""
        return fused_swiglu(gate_up)


def substitute(
    module: nn.Module, *, positions: int, dtype: torch.dtype, device: torch.device
) -> nn.Module | None:
    """``module``'s Triton substitute, or ``None`` to keep it (for
    :func:`~pagedkv.accel.substitution.substituted_copy`, with the arguments bound): a
    substitute already is kept as it is copied. The rotary embedding's table holds
    ``positions`` rows in ``dtype`` on ``device`` (the model's served context, activation
    dtype and device)."""
    if isinstance(module, TritonSubstitute):
        return None
    if type(module) is RMSNorm:
        return TritonRMSNorm.substitute(module)
    if type(module) is SwiGLUMLP:
        return TritonSwiGLUMLP.substitute(module)
    if type(module) is Qwen3MoeExperts:
        return TritonMoeExperts.substitute(module)
    if type(module) is RotaryEmbedding:
        return TableRotaryEmbedding.substitute(
            module, positions=positions, dtype=dtype, device=device
        )
    return None
