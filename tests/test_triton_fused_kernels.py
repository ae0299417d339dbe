"""The fused Triton kernels of ``fused_ops="triton"`` (ENG-221..ENG-223) against the reference
modules they stand in for, on small shapes (widths that are no power of two, several rows, rows
strided as views of wider products), under Triton's interpreter on a machine without CUDA
(PST-047), and each kernel's mutants shown to fail the same checks.

float32 is held to a few units in the last place (the order of a sum of squares' terms);
float16 nearly so. The interpreter truncates a float32 value cast to bfloat16 where a GPU
rounds it, so bfloat16 is held here only within a bfloat16 rounding or two: the GPU's own
16-bit path is held by the golden suites run there (GLD-055)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from kernel_mutants import NORM_MUTANTS, ROPE_MUTANTS, SWIGLU_MUTANTS, KernelMutant

from pagedkv.accel.cuda import norm_kernel, swiglu_kernel
from pagedkv.model.layers import RMSNorm, SwiGLUMLP
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.model.rope_config import RopeConfig

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within the dtype's tolerance (see the module's docstring)."""
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    if got.dtype == torch.float32:
        tolerance = 1e-5
    elif got.dtype == torch.float16:
        tolerance = 2e-3
    else:  # two bfloat16 roundings: the interpreter truncates where the reference rounds
        tolerance = 2**-6
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


def rows_of(rows: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``[rows, dim]`` random rows, a view of wider ones (rows ``dim + 3`` apart), its first row
    so small that ``eps`` weighs in its norm."""
    wide = torch.randn(rows, dim + 3, generator=gen)
    wide[0] *= 1e-3
    return wide.to(dtype)[:, :dim]


def norm_of(dim: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    """A reference norm of random weights (each channel its own)."""
    norm = RMSNorm(dim, EPS)
    norm.weight.data = 1 + 0.5 * torch.randn(dim, generator=gen)
    return norm.to(dtype)


def check_norm(kernels: ModuleType, dim: int, dtype: torch.dtype, seed: int = 0) -> None:
    """``kernels.rms_norm`` of five strided rows, with and without a residual, against the
    reference ``add_forward`` and ``forward``; the sum bit for bit in float32. ``seed``
    varies the inputs (see :data:`MUTANT_SEED`)."""
    gen = torch.Generator().manual_seed(dim + seed)
    norm = norm_of(dim, dtype, gen)
    x = rows_of(5, dim, dtype, gen)
    residual = (2 * torch.randn(5, dim, generator=gen)).to(dtype)
    total, out = kernels.rms_norm(x, residual, norm.weight, EPS)
    want_total, want_out = norm.add_forward(x, residual)
    if dtype == torch.float32:
        assert torch.equal(total, want_total)
    close(total, want_total)
    close(out, want_out)
    same, alone = kernels.rms_norm(x, None, norm.weight, EPS)
    assert same is x
    close(alone, norm(x))


def check_rope(kernels: ModuleType, head_dim: int, dtype: torch.dtype, seed: int = 0) -> None:
    """``kernels.rms_norm_rope`` of the query part of a merged product (three heads of four
    tokens, at positions far apart) against the reference ``rotated``."""
    gen = torch.Generator().manual_seed(head_dim + seed)
    tokens, heads = 4, 3
    norm = norm_of(head_dim, dtype, gen)
    product = torch.randn(tokens, (heads + 2) * head_dim, generator=gen)
    product[1, :head_dim] *= 1e-3  # one head so small that eps weighs in its norm
    query = product.to(dtype)[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    rope = RotaryEmbedding(RopeConfig(rope_type="default", theta=10000.0), head_dim)
    cos, sin = rope(torch.tensor([0, 3, 17, 250]), dtype)
    close(kernels.rms_norm_rope(query, norm.weight, cos, sin, EPS), norm.rotated(query, cos, sin))


def check_swiglu(kernels: ModuleType, width: int, dtype: torch.dtype, seed: int = 0) -> None:
    """``kernels.swiglu`` of three rows of a wider product, cut into blocks of 8 columns,
    against the reference activation."""
    gen = torch.Generator().manual_seed(width + seed)
    product = (3 * torch.randn(3, 2 * width + 5, generator=gen)).to(dtype)
    gate_up = product[:, : 2 * width]
    mlp = SwiGLUMLP(4, width)
    close(kernels.swiglu(gate_up, block=8), mlp.activation(gate_up))


@pytest.mark.spec("ENG-221")
@pytest.mark.parametrize("dim", [24, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_kernel_matches_the_reference_add_and_norm(dim: int, dtype: torch.dtype) -> None:
    """Widths that are no power of two (masked blocks of 32 and 128). Kills the mutants of
    ``NORM_MUTANTS`` (shown by :func:`test_every_kernel_mutant_fails_its_check`)."""
    check_norm(norm_kernel, dim, dtype)


@pytest.mark.spec("ENG-222")
@pytest.mark.parametrize("head_dim", [10, 24])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_rope_kernel_matches_the_reference_rotated_norm(
    head_dim: int, dtype: torch.dtype
) -> None:
    """Head sizes that are no power of two, heads read from a wider product. Kills the
    mutants of ``ROPE_MUTANTS``."""
    check_rope(norm_kernel, head_dim, dtype)


@pytest.mark.spec("ENG-223")
@pytest.mark.parametrize("width", [20, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_kernel_matches_the_reference_activation(width: int, dtype: torch.dtype) -> None:
    """Rows of several blocks, the last one partial. Kills the mutants of
    ``SWIGLU_MUTANTS``."""
    check_swiglu(swiglu_kernel, width, dtype)


@pytest.mark.spec("ENG-221", "ENG-222", "ENG-223")
def test_kernels_take_steps_without_rows() -> None:
    """A step of no rows launches nothing (a grid of zero programs is an error on a GPU) and
    gives empty outputs. Kills a wrapper that launches regardless."""
    empty = torch.empty(0, 8)
    total, out = norm_kernel.rms_norm(empty, empty, torch.ones(8), EPS)
    assert total.shape == out.shape == (0, 8)
    rotated = norm_kernel.rms_norm_rope(
        torch.empty(0, 2, 8), torch.ones(8), torch.empty(0, 8), torch.empty(0, 8), EPS
    )
    assert rotated.shape == (0, 2, 8)
    assert swiglu_kernel.swiglu(torch.empty(0, 16)).shape == (0, 8)


#: First seed of the mutants' checks: each mutant's check has inputs of its own, unlike those
#: of every other check in the process. A mutant that leaves part of its output unwritten
#: returns what its fresh tensor's memory held, and the allocator hands back the block an
#: earlier check of the same inputs freed, which held the right values: ``sum_not_written``
#: passed twice in full runs, once after an unmutated check of the same inputs, once after
#: ``norm_before_the_add`` (which writes the sum) when all the mutants shared one seed.
MUTANT_SEED = 1_000_003

_MUTANT_CHECKS = (
    *((m, check_norm, 24) for m in NORM_MUTANTS),
    *((m, check_rope, 24) for m in ROPE_MUTANTS),
    *((m, check_swiglu, 20) for m in SWIGLU_MUTANTS),
)


def _float32_check(
    check: Callable[[ModuleType, int, torch.dtype, int], None], size: int, seed: int
) -> Callable[[ModuleType], None]:
    return lambda kernels: check(kernels, size, torch.float32, seed)


CHECKS: dict[str, tuple[KernelMutant, Callable[[ModuleType], None]]] = {
    m.name: (m, _float32_check(check, size, MUTANT_SEED + i))
    for i, (m, check, size) in enumerate(_MUTANT_CHECKS)
}


@pytest.mark.spec("ENG-221", "ENG-222", "ENG-223")
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_kernel_mutant_fails_its_check(name: str, tmp_path: Path) -> None:
    """Each mutant of ``tests/kernel_mutants.py`` fails the float32 check its kernel passes:
    the norm's sum not written back, eps outside the root, the norm taken before the add; the
    rotation's halves swapped, the partner channel scaled by the wrong weight, eps outside the
    root; gate and up swapped, a column block ignored."""
    mutant, check = CHECKS[name]
    assert isinstance(mutant, KernelMutant)
    with pytest.raises(AssertionError):
        check(mutant.load(tmp_path))
