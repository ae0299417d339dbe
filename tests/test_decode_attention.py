"""Decode attention without a gathered copy: the C kernel and the compiled pass (PST-008,
PST-009)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from test_attention_layout import PAGE, expected, filled_store, ragged_batch
from test_paged_store import ATOL
from torch.profiler import ProfilerActivity, profile

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import StoreConfig
from pagedkv.native.build import BuildFailure, build_library
from pagedkv.store import decode_attention, native_decode
from pagedkv.store.native_decode import NativeDecode
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv.testing.tiny_qwen3 import one_torch_thread

HEAD_DIM = 64
#: Decode contexts of one group (each at least DECODE_FILL of the longest): padded gathers.
CONTEXTS = [200, 190, 180, 150, 199, 160, 171, 200]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def decode_store(dtype: str = "float32", fused: bool | None = None) -> TorchPagedStore:
    """One layer of HEAD_DIM-wide heads, every slot random."""
    return filled_store(1, 512, head_dim=HEAD_DIM, dtype=dtype, fused_decode=fused)


def largest_allocation(run: Callable[[], object]) -> int:
    """Bytes of the largest CPU allocation made while ``run`` runs, compiled code included
    (every allocation the profiler records, not each operator's net)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    assert prof.profiler is not None
    events = prof.profiler.kineto_results.events()
    return max(e.nbytes() for e in events if e.name() == "[memory]")


@pytest.mark.spec("PST-008")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_pass_allocates_no_gather(dtype: str) -> None:
    """Fused, a decode step allocates less than one gathered K (``sequences x width`` rows of
    the pool, in its dtype): scores are ``sequences x width x heads``, the output
    ``sequences x heads x head_dim``. Gathered, it allocates the K and V copies (and float32
    copies of 16-bit ones), which shows the measure sees them."""
    half = getattr(torch, dtype)
    query = torch.randn(len(CONTEXTS), 4, HEAD_DIM).to(half)
    gather = len(CONTEXTS) * max(CONTEXTS) * 2 * HEAD_DIM * half.itemsize
    largest = {
        fused: _largest_of_a_step(decode_store(dtype, fused), query) for fused in (True, False)
    }
    assert largest[True] < gather <= largest[False]


def _largest_of_a_step(store: TorchPagedStore, query: torch.Tensor) -> int:
    metadata = store.prepare(ragged_batch([1] * len(CONTEXTS), CONTEXTS))
    store.attention(0, query, metadata, 0.3)  # compiled on the first call
    return largest_allocation(partial(store.attention, 0, query, metadata, 0.3))


@pytest.mark.spec("PST-008", "PST-013")
@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_gathered_decode_give_the_dense_result(fused: bool) -> None:
    """Both paths give every sequence its dense float64 attention over its own positions;
    the stale slots past each context (random here, NaN below) never reach it."""
    store = decode_store(fused=fused)
    batch = ragged_batch([1] * len(CONTEXTS), CONTEXTS)
    assert batch.page_tables is not None
    for b, context in enumerate(CONTEXTS):  # the tail of each last page: past the context
        if context % PAGE == 0:
            continue  # a full last page: no tail
        last = int(batch.page_tables[b, (context - 1) // PAGE])
        for pool in (store.key_pool(0), store.value_pool(0)):
            pool[last * PAGE + context % PAGE : (last + 1) * PAGE] = float("nan")
    query = torch.randn(len(CONTEXTS), 4, HEAD_DIM)
    got = store.attention(0, query, store.prepare(batch), 0.3)
    want = expected(store, 0, query.double(), batch)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)


@pytest.mark.spec("PST-008")
def test_fused_decode_off_the_cpu_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="fused_decode"):
        TorchPagedStore(StoreConfig(1, 2, 8, 4, 4, device="meta"), fused_decode=True)
    assert not TorchPagedStore(StoreConfig(1, 2, 8, 4, 4, "bfloat16", device="meta")).fused_decode


@pytest.mark.spec("PST-008")
def test_fused_by_default_on_the_cpu() -> None:
    """The C kernel for float32 and bfloat16 pools, the compiled pass for float16."""
    for dtype, kernel in (
        ("float32", NativeDecode),
        ("bfloat16", NativeDecode),
        ("float16", decode_attention.CompiledDecode),
    ):
        store = TorchPagedStore(StoreConfig(1, 2, 8, 4, 4, dtype))
        assert store.fused_decode
        assert isinstance(store._decode, kernel)
    assert not TorchPagedStore(StoreConfig(1, 2, 8, 4, 4), fused_decode=False).fused_decode


@pytest.mark.spec("PST-008", "PST-009")
def test_without_a_compiler_the_default_gathers_and_true_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(decode_attention, "can_compile", lambda: False)
    assert isinstance(NativeDecode.build(torch.float32), BuildFailure)
    assert not decode_store("bfloat16").fused_decode
    assert not decode_store().fused_decode
    with pytest.raises(InvalidRequest, match="no C compiler"):
        decode_store(fused=True)


@pytest.mark.spec("PST-009")
def test_a_failed_build_says_why_and_leaves_no_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    failure = build_library(native_decode.SOURCE, tmp_path)
    assert isinstance(failure, BuildFailure)
    assert "failed" in failure.reason
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.spec("PST-009")
def test_a_built_library_is_reused_and_named_by_its_source(tmp_path: Path) -> None:
    first = build_library(native_decode.SOURCE, tmp_path)
    assert isinstance(first, Path)
    built = first.stat().st_mtime_ns
    assert build_library(native_decode.SOURCE, tmp_path) == first
    assert first.stat().st_mtime_ns == built
    changed = tmp_path / "src" / native_decode.SOURCE.name
    changed.parent.mkdir()
    changed.write_text(native_decode.SOURCE.read_text() + "\n/* another source */\n")
    other = build_library(changed, tmp_path)
    assert isinstance(other, Path)
    assert other != first
    assert build_library(native_decode.SOURCE, tmp_path, ("-O2",)) not in (first, other)


@pytest.mark.spec("PST-009")
def test_a_library_is_named_by_the_headers_its_source_includes(tmp_path: Path) -> None:
    """A source including a header beside it: the library's name changes when only the
    header does, and a source including the shared header finds it on the include path."""
    source = tmp_path / "kernel.c"
    source.write_text('#include "value.h"\nint value(void) { return VALUE; }\n')
    header = tmp_path / "value.h"
    header.write_text("#define VALUE 1\n")
    first = build_library(source, tmp_path / "cache")
    assert isinstance(first, Path)
    header.write_text("#define VALUE 2\n")
    second = build_library(source, tmp_path / "cache")
    assert isinstance(second, Path)
    assert second != first
    shared = tmp_path / "shared.c"
    shared.write_text('#include "fast_exp.h"\nfloat one(void) { return exp_nonpositive(0.0f); }\n')
    assert isinstance(build_library(shared, tmp_path / "cache"), Path)


@pytest.mark.spec("PST-009", "PST-013", "PST-041")
@pytest.mark.parametrize("group", [1, 2, 3, 5])
@pytest.mark.parametrize("head_dim", [16, 24, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_reads_only_each_context(
    dtype: torch.dtype, head_dim: int, group: int
) -> None:
    """One, two and six sequences (so, at one thread, tasks of one, two and all four KV heads)
    over a pool whose every slot past the contexts is NaN: the float64 dense result of the
    positions below each context. Where the CPU has AVX-512, head dimensions 16, 80 and 128
    take the register-blocked code (one, five and eight 16-lane chunks: values summed for four,
    two and two query heads a pass, so groups of 3 and 5 end on a short pass), 256 the 16-lane
    code without it; 24 the portable loops."""
    kernel = NativeDecode.build(dtype)
    assert isinstance(kernel, NativeDecode)
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(256, 4, head_dim, generator=generator).to(dtype)
    values = torch.randn(256, 4, head_dim, generator=generator).to(dtype)
    lengths = torch.tensor([7, 30, 19, 1, 16, 25])
    kv_index = torch.randperm(256, generator=generator)[:180].view(6, 30)
    for b, length in enumerate(lengths.tolist()):
        keys[kv_index[b, length:]] = float("nan")  # stale slots past the context
        values[kv_index[b, length:]] = float("nan")
    query = torch.randn(6, 4 * group, head_dim, generator=generator).to(dtype)
    # At scale 40 the scores spread over hundreds, so a softmax shifted by less than the row's
    # largest score overflows.
    for seqs, scale in itertools.product(([0], [0, 1], [0, 1, 2, 3, 4, 5]), (0.3, 40.0)):
        got = kernel(query[seqs], keys, values, kv_index[seqs], lengths[seqs], scale)
        for row, b in enumerate(seqs):
            slots = kv_index[b, : int(lengths[b])]
            k = keys[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
            v = values[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = query[b].double()[:, None, :] @ k.transpose(1, 2) * scale
            want = (torch.softmax(scores, -1) @ v)[:, 0]
            # A float32 rounding of a score is multiplied by the scale before the exp, so the
            # tolerance grows with it; a bfloat16 result is also rounded to 8 bits.
            if dtype == torch.float32:
                torch.testing.assert_close(
                    got[row].double(), want, atol=1e-5 * max(1.0, scale), rtol=0
                )
            else:
                torch.testing.assert_close(got[row].double(), want, atol=1e-2, rtol=2**-8)


@pytest.mark.spec("PST-009")
@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16])
def test_a_bfloat16_query_is_read_and_answered_in_bfloat16(pool: torch.dtype) -> None:
    """Bit for bit the float32 call on the converted query, rounded to bfloat16; a float32
    query is answered in float32, a float16 one in float16."""
    kernel = NativeDecode.build(pool)
    assert isinstance(kernel, NativeDecode)
    generator = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(64, 2, 32, generator=generator).to(pool) for _ in range(2))
    kv_index = torch.randperm(64, generator=generator)[:60].view(3, 20)
    lengths = torch.tensor([20, 3, 11])
    query = torch.randn(3, 4, 32, generator=generator)
    as_float32 = kernel(query.bfloat16().float(), keys, values, kv_index, lengths, 0.2)
    got = kernel(query.bfloat16(), keys, values, kv_index, lengths, 0.2)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, as_float32.bfloat16())
    assert as_float32.dtype == torch.float32
    assert kernel(query.half(), keys, values, kv_index, lengths, 0.2).dtype == torch.float16


def test_this_machine_has_the_compilers_the_fused_paths_need() -> None:
    """The default stores here are fused, so the suite checks the fused paths, not the
    fallback."""
    assert decode_attention.can_compile()
    assert isinstance(NativeDecode.build(torch.float32), NativeDecode)


@pytest.mark.spec("PST-009")
def test_inside_torch_compile_the_kernel_hands_over_to_the_compiled_formulation() -> None:
    """A whole-graph compile of a call to the kernel succeeds (a foreign call would break the
    graph and ``fullgraph=True`` refuses that) and gives the kernel's own result."""
    kernel = NativeDecode.build(torch.float32)
    assert isinstance(kernel, NativeDecode)
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(40, 2, HEAD_DIM, generator=generator) for _ in range(2))
    query = torch.randn(2, 4, HEAD_DIM, generator=generator)
    kv_index = torch.randperm(40, generator=generator)[:32].view(2, 16)
    lengths = torch.tensor([16, 9])
    compiled = torch.compile(kernel.__call__, fullgraph=True)
    got = compiled(query, keys, values, kv_index, lengths, 0.3)
    torch.testing.assert_close(got, kernel(query, keys, values, kv_index, lengths, 0.3))
