"""The SwiGLU activation ``silu(gate) * up`` in one C call (ENG-159)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.accel.cpu.fused_swiglu import FusedSwiGLU, FusedSwiGLUMLP
from pagedkv.model.layers import SwiGLUMLP
from pagedkv.testing.tiny_qwen3 import (
    one_torch_thread,
    torch_threads,
)

DTYPES = [torch.float32, torch.bfloat16]
#: Inputs torch's silu meets at its edges: NaN, both infinities, zeros of both signs, and
#: gates where exp(-g) overflows (g < -88.7), is denormal (g > 87.3) or is near either.
EDGES = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -88.8, -88.7, -88.0, -87.4]
EDGES += [87.4, 88.1, 100.0, -100.0, 1e-30, -1e-30]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


class Counted:
    """A kernel entry point that counts its calls."""

    def __init__(self, entry: Callable[..., None]) -> None:
        self.entry = entry
        self.calls = 0

    def __call__(self, *args: Any) -> None:
        self.calls += 1
        self.entry(*args)


def counted_kernel(dtype: torch.dtype, *flags: str) -> tuple[FusedSwiGLU, Counted]:
    """A fresh kernel for ``dtype`` (built with ``flags``) whose entry point counts its calls."""
    kernel = FusedSwiGLU.build(dtype, extra_flags=flags)
    assert isinstance(kernel, FusedSwiGLU), kernel
    entry = Counted(kernel._swiglu)
    kernel._swiglu = entry  # type: ignore[assignment]
    return kernel, entry


def torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def spread_product(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A gate/up product ``[rows, 2 * width]`` whose rows span small to large gates (scales 0.1
    to 60), the first row's first gates the edge cases (their ups random)."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1.8, rows)[:, None]
    product = torch.randn(rows, 2 * width, generator=generator) * scales
    edges = torch.tensor(EDGES[:width])
    product[0, : len(edges)] = edges
    return product.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (NaN included)."""
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def assert_torch_s(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: within 1e-6 of each of torch's values (1e-36 absolute); bfloat16: within one
    step of each and equal in at least 999 of 1000; NaN and infinities where torch's are."""
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert torch.equal(got.isnan(), expected.isnan())
    finite, infinite = expected.isfinite(), expected.isinf()
    assert torch.equal(got[infinite], expected[infinite])
    g, e = got[finite].double(), expected[finite].double()
    error = (g - e).abs()
    if got.dtype == torch.float32:
        assert bool((error <= 1e-6 * e.abs() + 1e-36).all()), error.max()
    else:
        assert bool((error <= e.abs() * 2**-7).all()), error.max()
        assert (got[finite] == expected[finite]).double().mean() >= 0.999


@pytest.mark.spec("ENG-159")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 16), (3, 3072), (70, 37)])
def test_the_activation_is_torch_s(dtype: torch.dtype, rows: int, width: int) -> None:
    """``silu(gate) * up`` of each row, gate the first half of the merged product; 37 columns
    end in a tail the 16 lanes do not cover, 70 rows take the threaded path."""
    product = spread_product(rows, width, dtype, seed=rows)
    kernel, entry = counted_kernel(dtype)
    with torch_threads(2):  # the threaded path on two threads, not a team of one
        got = kernel.swiglu(product)
    assert got.is_contiguous()
    assert_torch_s(got, torch_swiglu(product))
    assert entry.calls == 1


@pytest.mark.spec("ENG-159")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_read_where_they_lie(dtype: torch.dtype) -> None:
    """A product whose rows lie wider apart than gate and up (a view of a wider tensor) is read
    in place, each row from its own start."""
    wide = spread_product(5, 40, dtype, seed=7)
    view = wide[:, :64]  # gate 32 and up 32 columns of rows 80 apart
    assert view.stride(0) == 80
    kernel, entry = counted_kernel(dtype)
    assert kernel.takes(view)
    assert same_bits(kernel.swiglu(view), kernel.swiglu(view.contiguous()))
    assert_torch_s(kernel.swiglu(view), torch_swiglu(view))
    assert entry.calls == 3


@pytest.mark.spec("ENG-159")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_16_lane_and_portable_builds_give_the_same_bits(dtype: torch.dtype) -> None:
    product = spread_product(9, 3072 + 5, dtype, seed=3)
    lanes, _ = counted_kernel(dtype)
    portable, _ = counted_kernel(dtype, "-DPAGEDKV_PORTABLE")
    assert same_bits(lanes.swiglu(product), portable.swiglu(product))


@pytest.mark.spec("ENG-159")
def test_products_the_kernel_does_not_take_stay_with_torch() -> None:
    """A product of another dtype or with strided columns runs torch's formulation (no
    kernel call), and an odd row is refused."""
    generator = torch.Generator().manual_seed(0)
    mlp = SwiGLUMLP(16, 24).to(torch.bfloat16)
    for parameter in mlp.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator).to(torch.bfloat16)
    x = torch.randn(3, 16, generator=generator).to(torch.bfloat16)
    expected = mlp(x)
    kernel, entry = counted_kernel(torch.float32)
    mlp = FusedSwiGLUMLP.substitute(mlp, kernel)
    assert torch.equal(mlp(x), expected)
    assert entry.calls == 0
    strided = torch.randn(48, 2, generator=generator).t()
    assert not mlp.kernel.takes(strided)
    with pytest.raises(ValueError, match="even row, not 7"):
        mlp.kernel.swiglu(torch.zeros(2, 7))
    kernel, entry = counted_kernel(torch.bfloat16)
    mlp = FusedSwiGLUMLP.substitute(mlp, kernel)
    assert_torch_s(mlp.kernel.swiglu(mlp.gate_up_proj(x)), torch_swiglu(mlp.gate_up_proj(x)))
    assert torch.equal(mlp(x), expected)  # the model's own rounding: equal here
    assert entry.calls == 2


@pytest.mark.spec("ENG-159")
def test_inside_torch_compile_the_torch_formulation_runs() -> None:
    """A whole-graph compile of a fused MLP works (the kernel hands over) and gives the eager
    result to rounding."""
    generator = torch.Generator().manual_seed(0)
    mlp = SwiGLUMLP(16, 24)
    for parameter in mlp.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator)
    x = torch.randn(3, 16, generator=generator)
    kernel, entry = counted_kernel(torch.float32)
    mlp = FusedSwiGLUMLP.substitute(mlp, kernel)
    compiled = torch.compile(mlp.forward, fullgraph=True)
    got = compiled(x)
    assert entry.calls == 0
    eager = mlp(x)
    assert entry.calls == 1
    assert torch.allclose(got, eager, rtol=1e-5, atol=1e-6)
