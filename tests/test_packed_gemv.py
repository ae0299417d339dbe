"""Products of a few rows read straight from oneDNN's packed weights (ENG-117)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_fused_norms import Counted
from test_runner_options import generate, paged_runner

from pagedkv.accel.cpu.onednn import onednn_linear, packing_supported
from pagedkv.accel.cpu.packed_gemv import (
    AMX_ROWS,
    MAX_ROWS,
    WIDE_ENTRIES,
    WIDE_ROWS,
    PackedGemv,
)
from pagedkv.accel.cpu.packed_layout import (
    AMX_LAYOUT,
    LAYOUTS,
    BlockedLayout,
    PackedWeight,
    packed_bytes,
    read_layout,
)
from pagedkv.accel.cpu.packed_linear import PackedProduct, has_packed_gemv, packed
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.model.layers import Linear
from pagedkv.model.loader import load_model
from pagedkv.testing.tiny_qwen3 import PRESETS, build_tiny_checkpoint, torch_threads

DTYPES = [torch.float32, torch.bfloat16]
#: (out, in): whole blocks, padded outputs, padded inputs, both padded and wider than a group
#: of four output blocks, an odd input count (a half-filled bfloat16 pair).
SHAPES = [(128, 64), (100, 72), (33, 50), (300, 96), (7, 5)]


@pytest.fixture(autouse=True, scope="module")
def _two_torch_threads() -> Iterator[None]:
    with torch_threads(2):
        yield


#: The kernel as built for this CPU, and built as for a CPU without a bfloat16 dot product.
BUILDS = [(), ("-DPAGEDKV_PORTABLE",)]


def counted_kernel(flags: tuple[str, ...] = ()) -> tuple[PackedGemv, dict[str, Counted]]:
    """The kernel with every entry point counted: by layout name, ``"wide " + name`` and
    ``"amx"``."""
    kernel = PackedGemv.build(extra_flags=flags)
    assert isinstance(kernel, PackedGemv), kernel
    counts = {name: Counted(entry) for name, entry in kernel._entries.items()}
    kernel._entries = {name: counts[name] for name in kernel._entries}
    for name, entry in kernel._wide.items():
        counts[f"wide {name}"] = kernel._wide[name] = Counted(entry)
    if kernel._amx is not None:
        counts["amx"] = kernel._amx = Counted(kernel._amx)
    return kernel, counts


def within_one_step(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """Float32: within 1e-5 of the exact product relative to its largest value; bfloat16: within
    one bfloat16 step of it (and the float32 sum's own error, relative to the largest value)."""
    error = (got.double() - exact).abs()
    scale = exact.abs().max().item()
    if got.dtype == torch.float32:
        return bool((error <= 1e-5 * scale).all())
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    return bool((error <= step + 1e-5 * scale).all())


def assert_products(
    kernel: PackedGemv,
    blocked: PackedWeight,
    weight: torch.Tensor,
    bias: torch.Tensor,
    row_counts: range,
    generator: torch.Generator,
) -> None:
    """Each row count, with and without ``bias``, rows further apart than their width (NaN
    between them, which a read past a row would carry into the result): taken by ``kernel``
    and within one step of the exact product."""
    out_features, in_features = weight.shape
    for rows in row_counts:
        wide = torch.randn(rows, in_features + 3, generator=generator).to(weight.dtype)
        wide[:, in_features:] = float("nan")
        x = wide[:, :in_features]
        for with_bias in (None, bias):
            assert kernel.takes(x, blocked, with_bias)
            got = kernel.product(x, blocked, out_features, with_bias)
            exact = x.double() @ weight.double().T
            if with_bias is not None:
                exact += with_bias.double()
            assert got.shape == (rows, out_features)
            assert got.dtype == weight.dtype
            assert within_one_step(got, exact), (rows, with_bias is None)


@pytest.mark.spec("ENG-117")
@pytest.mark.parametrize("flags", BUILDS, ids=["native", "portable"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_computes_the_product_in_each_layout(
    layout: BlockedLayout, shape: tuple[int, int], flags: tuple[str, ...]
) -> None:
    """On weights laid out by the layout's own packing (so on any CPU, whatever oneDNN would
    choose): 1 to 4 rows, rows further apart than their width, a leading batch dimension, a
    bias."""
    generator = torch.Generator().manual_seed(sum(shape))
    out_features, in_features = shape
    dtype = layout.dtype
    weight = torch.randn(shape, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = layout.pack(weight)
    blocked = PackedWeight(layout, packed.data_ptr())
    kernel, counts = counted_kernel(flags)
    # This file's own entry for the AMX layout too, which takes its products where the tiles
    # are not granted (ENG-118 takes them where they are).
    kernel._amx = None
    counts.pop("amx", None)
    assert_products(kernel, blocked, weight, bias, range(1, MAX_ROWS + 1), generator)
    batched = torch.randn(2, 2, in_features, generator=generator).to(dtype)
    got = kernel.product(batched, blocked, out_features, None)
    assert got.shape == (2, 2, out_features)
    assert within_one_step(got, batched.double() @ weight.double().T)
    assert counts[layout.name].calls == 2 * MAX_ROWS + 1
    assert sum(c.calls for c in counts.values()) == counts[layout.name].calls


def amx_kernel() -> tuple[PackedGemv, dict[str, Counted]]:
    kernel, counts = counted_kernel()
    if kernel._amx is None:
        pytest.skip("this CPU (or Linux) gives the process no AMX tiles")
    return kernel, counts


@pytest.mark.spec("ENG-118")
@pytest.mark.parametrize("shape", [*SHAPES, (1024, 1024)])
def test_the_amx_kernel_computes_bfloat16_products_of_1_to_32_rows(shape: tuple[int, int]) -> None:
    """Every row count from 1 to 32 (one and two row tiles, each partly filled), rows further
    apart than their width, a leading batch dimension, with and without a bias: within one
    bfloat16 step of the exact product."""
    generator = torch.Generator().manual_seed(sum(shape))
    out_features, in_features = shape
    weight = torch.randn(shape, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    layout = AMX_LAYOUT
    packed = layout.pack(weight)
    blocked = PackedWeight(layout, packed.data_ptr())
    kernel, counts = amx_kernel()
    assert kernel.max_rows(layout) == AMX_ROWS
    # The float32 layout keeps its own limit: 8 rows where its wide entry is built (ENG-119).
    float32_rows = WIDE_ROWS if LAYOUTS[0].name in kernel._wide else MAX_ROWS
    assert kernel.max_rows(LAYOUTS[0]) == float32_rows
    assert_products(kernel, blocked, weight, bias, range(1, AMX_ROWS + 1), generator)
    batched = torch.randn(3, 7, in_features, generator=generator).to(torch.bfloat16)
    got = kernel.product(batched, blocked, out_features, None)
    assert got.shape == (3, 7, out_features)
    assert within_one_step(got, batched.double() @ weight.double().T)
    assert counts["amx"].calls == 2 * AMX_ROWS + 1
    assert counts[layout.name].calls == 0


@pytest.mark.spec("ENG-118")
def test_the_amx_kernel_rounds_once_to_nearest_even() -> None:
    """Rows that pick one input each make every output a weight plus the bias, exact in
    float32; with weights 1 + k/128 and a bias of +-1/256 every sum lies halfway between two
    bfloat16 values, so the output is torch's own rounding of the float32 sum only if ties go
    to even."""
    generator = torch.Generator().manual_seed(3)
    out_features, in_features = 40, 24
    steps = torch.randint(0, 128, (out_features, in_features), generator=generator)
    weight = (1 + steps / 128).to(torch.bfloat16)
    signs = torch.randint(0, 2, (out_features,), generator=generator) * 2 - 1
    bias = (signs / 256).to(torch.bfloat16)
    layout = AMX_LAYOUT
    packed = layout.pack(weight)
    kernel, _ = amx_kernel()
    x = torch.eye(in_features, dtype=torch.bfloat16)[:AMX_ROWS]
    got = kernel.product(x, PackedWeight(layout, packed.data_ptr()), out_features, bias)
    want = (weight.T.float() + bias.float()).to(torch.bfloat16)
    assert torch.equal(got, want)


WIDE = [layout for layout in LAYOUTS if layout.name in WIDE_ENTRIES]


@pytest.mark.spec("ENG-119")
@pytest.mark.parametrize("layout", WIDE, ids=[layout.name for layout in WIDE])
@pytest.mark.parametrize("shape", [*SHAPES, (1024, 1024)])
def test_the_wide_entries_compute_products_of_5_to_8_rows(
    layout: BlockedLayout, shape: tuple[int, int]
) -> None:
    """Every row count from 5 to 8 in each 64-output layout, rows further apart than their
    width, a leading batch dimension, with and without a bias: within ENG-117's bounds of the
    exact product, each in one call of the layout's wide entry."""
    generator = torch.Generator().manual_seed(sum(shape))
    out_features, in_features = shape
    weight = torch.randn(shape, generator=generator).to(layout.dtype)
    bias = torch.randn(out_features, generator=generator).to(layout.dtype)
    packed = layout.pack(weight)
    blocked = PackedWeight(layout, packed.data_ptr())
    kernel, counts = counted_kernel()
    if layout.name not in kernel._wide:
        pytest.skip(f"this CPU has no wide entry for {layout.name}")
    assert kernel.max_rows(layout) == WIDE_ROWS
    assert_products(kernel, blocked, weight, bias, range(MAX_ROWS + 1, WIDE_ROWS + 1), generator)
    batched = torch.randn(2, 3, in_features, generator=generator).to(layout.dtype)
    got = kernel.product(batched, blocked, out_features, None)
    assert got.shape == (2, 3, out_features)
    assert within_one_step(got, batched.double() @ weight.double().T)
    assert counts[f"wide {layout.name}"].calls == 2 * (WIDE_ROWS - MAX_ROWS) + 1
    assert sum(c.calls for c in counts.values()) == counts[f"wide {layout.name}"].calls
    nine = torch.randn(WIDE_ROWS + 1, in_features).to(layout.dtype)
    assert not kernel.takes(nine, blocked, None)


@pytest.mark.spec("ENG-119")
@pytest.mark.parametrize("layout", WIDE, ids=[layout.name for layout in WIDE])
def test_built_portable_more_than_four_rows_stay_with_onednn(layout: BlockedLayout) -> None:
    """Built portable, no wide entry is offered: products of 5 rows in a 64-output layout are
    not taken, and one sent anyway is refused rather than computed."""
    packed = layout.pack(torch.randn(64, 32).to(layout.dtype))
    blocked = PackedWeight(layout, packed.data_ptr())
    kernel, _ = counted_kernel(("-DPAGEDKV_PORTABLE",))
    assert kernel._wide == {}
    assert kernel.max_rows(layout) == MAX_ROWS
    five = torch.randn(MAX_ROWS + 1, 32).to(layout.dtype)
    assert not kernel.takes(five, blocked, None)
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} rows, not {MAX_ROWS + 1}"):
        kernel.product(five, blocked, 64, None)


@pytest.mark.spec("ENG-118")
def test_without_amx_more_than_four_rows_stay_with_onednn() -> None:
    """Built portable, the AMX kernel reports no tiles: bfloat16 products of 5 rows are not
    taken, and one sent anyway is refused rather than computed by another kernel."""
    layout = AMX_LAYOUT
    blocked = PackedWeight(layout, layout.pack(torch.randn(64, 32).to(torch.bfloat16)).data_ptr())
    kernel, _ = counted_kernel(("-DPAGEDKV_PORTABLE",))
    assert kernel._amx is None
    assert kernel.max_rows(layout) == MAX_ROWS
    five = torch.randn(MAX_ROWS + 1, 32).to(torch.bfloat16)
    assert not kernel.takes(five, blocked, None)
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} rows, not {MAX_ROWS + 1}"):
        kernel.product(five, blocked, 64, None)


@pytest.mark.spec("ENG-117", "ENG-118")
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_the_kernel_takes_only_what_it_computes(layout: BlockedLayout) -> None:
    """At most :meth:`max_rows` rows: more than four only for the AMX kernel's layout where
    the CPU has AMX, and for the wide entry's where the kernel has the bfloat16 dot
    product."""
    dtype = layout.dtype
    weight = torch.randn(64, 32).to(dtype)
    packed = layout.pack(weight)
    blocked = PackedWeight(layout, packed.data_ptr())
    kernel, _ = counted_kernel()
    most = kernel.max_rows(layout)
    if layout == AMX_LAYOUT and kernel._amx is not None:
        assert most == AMX_ROWS
    elif layout.name in kernel._wide:
        assert most == WIDE_ROWS
    else:
        assert most == MAX_ROWS
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert kernel.takes(torch.randn(most, 32).to(dtype), blocked, None)
    assert not kernel.takes(torch.randn(most + 1, 32).to(dtype), blocked, None)
    assert not kernel.takes(torch.randn(1, 32).to(other), blocked, None)
    assert not kernel.takes(torch.randn(1, 64).to(dtype)[:, ::2], blocked, None)
    assert not kernel.takes(torch.randn(1, 32).to(dtype), blocked, torch.randn(64).to(other))
    with pytest.raises(ValueError, match=f"1 to {most} rows, not {most + 1}"):
        kernel.product(torch.randn(most + 1, 32).to(dtype), blocked, 64, None)


def packed_linear(shape: tuple[int, int], dtype: torch.dtype) -> tuple[PackedProduct, torch.Tensor]:
    """A packed layer of ``shape`` and a copy of its plain weight."""
    if not packing_supported(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN does not pack {dtype} weights on this CPU")
    out_features, in_features = shape
    layer = Linear(in_features, out_features, bias=True).to(dtype)
    weight = layer.weight.detach().clone()
    layer = packed(layer)
    if layer.packed_weight is None:
        pytest.skip(f"oneDNN packs {dtype} in a layout the kernel does not read on this CPU")
    return layer, weight


@pytest.mark.spec("ENG-117")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layout_is_named_only_when_onednns_bytes_equal_its_packing(dtype: torch.dtype) -> None:
    layer, weight = packed_linear((100, 72), dtype)
    assert layer.packed is not None
    assert layer.packed_weight is not None
    assert layer.packed_weight.layout in LAYOUTS
    assert layer.packed_weight.layout.dtype == dtype
    assert read_layout(weight, layer.packed) == layer.packed_weight
    # Another weight of the same shape and dtype: the bytes differ, so no layout is named.
    assert read_layout(torch.randn(100, 72).to(dtype), layer.packed) is None
    # The padding is compared too: its last byte (output 127 of 100) made nonzero.
    found = packed_bytes(layer.packed)
    assert found is not None
    found[-1] = 0x3F
    assert read_layout(weight, layer.packed) is None


@pytest.mark.spec("ENG-117")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_layer_runs_few_rows_through_the_kernel_and_more_through_onednn(
    dtype: torch.dtype,
) -> None:
    layer, weight = packed_linear((300, 96), dtype)
    assert layer.packed is not None
    assert layer.packed_weight is not None
    assert layer.bias is not None
    layout = layer.packed_weight.layout
    kernel, counts = counted_kernel()
    most = kernel.max_rows(layout)
    assert kernel.reads(layer.packed_weight)
    layer.gemv = kernel
    assert has_packed_gemv(layer)
    for rows in range(1, most + 2):
        x = torch.randn(rows, 96).to(dtype)
        got = layer(x)
        if rows <= most:
            exact = x.double() @ weight.double().T + layer.bias.double()
            assert within_one_step(got, exact)
        else:
            assert torch.equal(got, onednn_linear(x, layer.packed, layer.bias))
    amx = kernel._amx is not None and layout == AMX_LAYOUT
    assert counts[layout.name].calls == (0 if amx else MAX_ROWS)
    if kernel._amx is not None:
        assert counts["amx"].calls == (most if amx else 0)
    for name in kernel._wide:
        assert counts[f"wide {name}"].calls == (most - MAX_ROWS if layout.name == name else 0)
    layer.gemv = None
    assert not has_packed_gemv(layer)


@pytest.mark.spec("ENG-117", "ENG-111")
def test_the_runner_gives_the_kernel_where_it_can_and_refuses_what_it_cannot(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    checkpoint = build_tiny_checkpoint(PRESETS["tied-gqa2"], tmp_path / "tied")
    runner = paged_runner(checkpoint)
    if not has_packed_gemv(runner.model):
        pytest.skip("oneDNN packs the tiny model's float32 weights in another layout here")
    assert not has_packed_gemv(paged_runner(checkpoint, RunnerOptions(packed_gemv=False)).model)
    plain = RunnerOptions(pack_weights=False, packed_gemv=True)
    with pytest.raises(InvalidRequest, match="packed_gemv: no linear layer holds"):
        paged_runner(checkpoint, plain)
    with pytest.raises(InvalidRequest, match="packed_gemv=False"):
        ModelRunner.recompute(runner.model, RunnerOptions(packed_gemv=False))
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", "no-such-compiler")
    assert not has_packed_gemv(paged_runner(checkpoint).model)
    with pytest.raises(InvalidRequest, match="packed_gemv: no C compiler"):
        ModelRunner.recompute(load_model(checkpoint), RunnerOptions(packed_gemv=True))


@pytest.mark.spec("ENG-117", "ENG-110")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_generates_the_tokens_of_onednn(tmp_path: Path, dtype: str) -> None:
    """Greedy tokens with and without the kernel are the same, token for token (bfloat16:
    GLD-016's tolerance, and these prompts' margins are far above one step)."""
    path = build_tiny_checkpoint(PRESETS["untied-gqa4-wide"], tmp_path / dtype, dtype=dtype)

    def run(gemv: bool) -> list[list[int]]:
        runner = paged_runner(path, RunnerOptions(packed_gemv=gemv), dtype=dtype)
        assert has_packed_gemv(runner.model) == gemv
        return generate(runner)

    if not has_packed_gemv(paged_runner(path, dtype=dtype).model):
        pytest.skip(f"oneDNN packs the tiny model's {dtype} weights in another layout here")
    assert run(True) == run(False)
