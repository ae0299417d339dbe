"""What the machine allows: memory-read bandwidth and GEMM peak, measured in the run.

* **Read bandwidth** bounds batch-1 decode, which reads every weight once per token. It is the
  best of several kernels that stream one large float32 tensor (many times the size of the CPU
  caches): matrix-vector products (MKL's, and oneDNN's on the tensor packed for it), a sum and
  a copy (counting the bytes read). Taking the best keeps the bound from depending on how fast
  any one kernel, or the dtype under test, is: every dtype's decode is compared with the same
  bytes per second.
* **GEMM peak** bounds prefill and batched decode: the floating-point operations per second of
  a large float32 matrix product, the best of MKL's (``torch.mm``) and oneDNN's on a weight
  packed for it (which pagedkv itself runs: on the benchmark machine it reached about twice
  MKL's rate), so the peak is the machine's, not one library's.

Both use the torch threads of the run (the caller sets them), so they measure what the systems
compared with them can use; on ``cuda`` they measure the GPU's memory and matrix units.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.accel.cpu.onednn import onednn_linear, onednn_pack, packing_supported
from pagedkv.device import DEFAULT_DEVICE

#: Side of the square float32 matrix the read kernels stream: 16384^2 * 4 bytes = 1 GiB, more
#: than twice the largest last-level cache seen on the benchmark machines.
READ_SIDE = 16384
#: Side of the square float32 matrices of the GEMM peak measurement.
GEMM_SIDE = 2048


@dataclass(frozen=True, slots=True)
class ReadBandwidth:
    """The read rate of each kernel and the best of them.

    Attributes:
        kernels: kernel name to bytes read per second.
        tensor_bytes: bytes of the tensor each kernel streams.
    """

    kernels: dict[str, float]
    tensor_bytes: int

    @property
    def best(self) -> float:
        """The highest read rate, bytes per second: the bound's bandwidth."""
        return max(self.kernels.values())

    @property
    def best_kernel(self) -> str:
        """The kernel that reached :attr:`best`."""
        return max(self.kernels, key=lambda k: self.kernels[k])


def fastest(kernel: Callable[[], object], repeats: int, device: str = DEFAULT_DEVICE) -> float:
    """Seconds of the fastest of ``repeats`` timed calls after one warm-up call (on CUDA, each
    timed to the end of its kernels)."""

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize(device)

    kernel()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernel()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(
    side: int = READ_SIDE, repeats: int = 3, device: str = DEFAULT_DEVICE
) -> ReadBandwidth:
    """Bytes per second the machine reads from memory, by float32 kernels: matrix-vector
    products through MKL (``F.linear``) and, on a CPU with oneDNN, through oneDNN on the matrix
    packed for it (the kernel pagedkv's decode runs), a sum and a copy."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.empty(side, side).normal_(generator=generator).to(device)
    vector = torch.ones(1, side, device=device)
    nbytes = matrix.numel() * matrix.element_size()
    kernels: dict[str, float] = {}
    with torch.inference_mode():
        gemv = fastest(lambda: F.linear(vector, matrix), repeats, device)
        kernels["fp32_gemv"] = nbytes / gemv
        if packing_supported(matrix.dtype, matrix.device):
            packed = onednn_pack(matrix)
            kernels["fp32_gemv_onednn"] = nbytes / fastest(
                lambda: onednn_linear(vector, packed), repeats, device
            )
            del packed
        kernels["sum"] = nbytes / fastest(matrix.sum, repeats, device)
        target = torch.empty_like(matrix)
        kernels["copy"] = nbytes / fastest(lambda: target.copy_(matrix), repeats, device)
    return ReadBandwidth(kernels=kernels, tensor_bytes=nbytes)


def gemm_peak_flops(
    dtype: torch.dtype = torch.float32,
    side: int = GEMM_SIDE,
    repeats: int = 3,
    device: str = DEFAULT_DEVICE,
) -> float:
    """Floating-point operations per second of a ``side``-cubed matrix product in ``dtype``: the
    best of ``torch.mm`` and, on a CPU with oneDNN, oneDNN's product on a packed operand."""
    generator = torch.Generator().manual_seed(0)
    a = torch.empty(side, side).normal_(generator=generator).to(device, dtype)
    b = torch.empty(side, side).normal_(generator=generator).to(device, dtype)
    with torch.inference_mode():
        seconds = fastest(lambda: torch.mm(a, b), repeats, device)
        if packing_supported(b.dtype, b.device):
            packed = onednn_pack(b.t(), rows=side)
            seconds = min(seconds, fastest(lambda: onednn_linear(a, packed), repeats, device))
    return 2.0 * side**3 / seconds
