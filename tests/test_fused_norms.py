"""RMSNorm in one C call, with the residual add before it or the RoPE rotation after it
(ENG-116)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pagedkv.accel.cpu.fused_norms import MAX_CHANNELS, MAX_HEAD_DIM, FusedNorms, FusedRMSNorm
from pagedkv.model.layers import RMSNorm, apply_rotary
from pagedkv.testing.tiny_qwen3 import (
    one_torch_thread,
    torch_threads,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


class Counted:
    """A kernel entry point that counts its calls."""

    def __init__(self, entry: Callable[..., int]) -> None:
        self.entry = entry
        self.calls = 0

    def __call__(self, *args: Any) -> int:
        self.calls += 1
        return self.entry(*args)


def counted_kernel(dtype: torch.dtype) -> tuple[FusedNorms, Counted, Counted]:
    """A fresh kernel for ``dtype`` whose two entry points count their calls."""
    kernel = FusedNorms.build(dtype)
    assert isinstance(kernel, FusedNorms), kernel
    add, rope = Counted(kernel._add_rms_norm), Counted(kernel._rms_norm_rope)
    kernel._add_rms_norm, kernel._rms_norm_rope = add, rope  # type: ignore[assignment]
    return kernel, add, rope


def random_norm(dim: int, dtype: torch.dtype, generator: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6).to(dtype)
    norm.weight.data = (torch.rand(dim, generator=generator) + 0.5).to(dtype)
    return norm


def assert_within(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: within 4e-6 of the largest expected value; bfloat16: within two steps of each
    (a step of the normalised value, scaled by a weight up to 1.5 and rounded again)."""
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    error = (got.float() - expected.float()).abs()
    if got.dtype == torch.float32:
        assert error.max() <= 4e-6 * expected.abs().max(), error.max()
    else:
        assert bool((error <= expected.float().abs() * 2**-6).all()), error.max()


@pytest.mark.spec("ENG-116")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (3, 256), (130, 1024)])
def test_the_residual_add_and_norm_are_torch_s(dtype: torch.dtype, rows: int, dim: int) -> None:
    """The residual sum bit for bit, the norm to rounding and of the sum as rounded to the
    dtype; 130 rows take the threaded path."""
    generator = torch.Generator().manual_seed(rows)
    norm = random_norm(dim, dtype, generator)
    x = (3 * torch.randn(rows, dim, generator=generator)).to(dtype)
    residual = torch.randn(rows, dim, generator=generator).to(dtype)
    expected_sum, expected_norm, expected_plain = x + residual, norm(x + residual), norm(x)
    kernel, add, _ = counted_kernel(dtype)
    norm = FusedRMSNorm.substitute(norm, kernel)
    with torch_threads(2):  # the threaded path on two threads, not a team of one
        total, normed = norm.add_forward(x, residual)
        assert torch.equal(total, expected_sum)
        assert_within(normed, expected_norm)
        assert torch.equal(normed, norm(total))  # the norm reads the sum as rounded
        assert_within(norm(x), expected_plain)
    assert add.calls == 3


@pytest.mark.spec("ENG-116")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "dim"), [(1, 64), (40, 128)])
def test_the_head_norm_and_rotation_are_torch_s(dtype: torch.dtype, tokens: int, dim: int) -> None:
    """Query and key heads read where they lie in a fused q/k/v product (rows wider than
    the heads), normalised and rotated as ``apply_rotary(norm(x))``; 40 tokens of 4 heads
    take the threaded path."""
    heads, kv_heads = 4, 2
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    cos = torch.randn(tokens, dim, generator=generator).to(dtype)
    sin = torch.randn(tokens, dim, generator=generator).to(dtype)
    norm = random_norm(dim, dtype, generator)
    query = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    key = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    expected = [apply_rotary(norm(x), cos, sin) for x in (query, key)]
    kernel, _, rope = counted_kernel(dtype)
    norm = FusedRMSNorm.substitute(norm, kernel)
    for x, want in zip((query, key), expected, strict=True):
        with torch_threads(2):  # the threaded path on two threads, not a team of one
            got = norm.rotated(x, cos, sin)
        assert got.is_contiguous()
        assert_within(got, want)
    assert rope.calls == 2


@pytest.mark.spec("ENG-116")
def test_inputs_the_kernel_does_not_take_stay_with_torch() -> None:
    """Rows wider than the kernel's buffers, heads wider than its rotation's and a residual of
    another dtype run the torch formulation (no kernel call for them); a strided residual is
    copied, then fused."""
    generator = torch.Generator().manual_seed(1)
    wide = random_norm(MAX_CHANNELS + 1, torch.float32, generator)
    x = torch.randn(2, MAX_CHANNELS + 1, generator=generator)
    expected = wide(x)
    kernel, add, rope = counted_kernel(torch.float32)
    wide = FusedRMSNorm.substitute(wide, kernel)
    assert torch.equal(wide(x), expected)
    head = MAX_HEAD_DIM + 2
    norm = random_norm(head, torch.float32, generator)
    heads, cos, sin = torch.randn(3, 2, head), torch.randn(3, head), torch.randn(3, head)
    expected = apply_rotary(norm(heads), cos, sin)
    norm = FusedRMSNorm.substitute(norm, wide.kernel)
    assert_within(norm.rotated(heads, cos, sin), expected)
    assert (add.calls, rope.calls) == (1, 0)  # the norm alone fused, then torch's rotation
    small = random_norm(64, torch.float32, generator)
    rows, other = torch.randn(5, 64), torch.randn(5, 64, dtype=torch.float64)
    expected_sum, expected_norm = small.add_forward(rows, other)
    small = FusedRMSNorm.substitute(small, wide.kernel)
    total, normed = small.add_forward(rows, other)
    assert torch.equal(total, expected_sum)
    assert torch.equal(normed, expected_norm)
    assert add.calls == 1
    strided = torch.randn(64, 5).t()
    contiguous = small.add_forward(rows, strided.contiguous())
    for got, want in zip(small.add_forward(rows, strided), contiguous, strict=True):
        assert torch.equal(got, want)
    assert add.calls == 3


@pytest.mark.spec("ENG-116")
def test_inside_torch_compile_the_torch_formulation_runs() -> None:
    """A whole-graph compile of a fused norm works (the kernel hands over) and gives the
    eager result to rounding."""
    generator = torch.Generator().manual_seed(0)
    norm = random_norm(64, torch.float32, generator)
    x, residual = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    cos, sin = torch.randn(2, 64), torch.randn(2, 64)
    kernel, add, rope = counted_kernel(torch.float32)
    norm = FusedRMSNorm.substitute(norm, kernel)

    def step(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        total, normed = norm.add_forward(x, residual)
        return norm.rotated(normed, cos, sin) + total

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(x, residual)
    assert add.calls == rope.calls == 0
    assert_within(got, step(x, residual))
    assert add.calls == rope.calls == 1
