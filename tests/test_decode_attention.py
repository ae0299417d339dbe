"""Decode attention fused into one compiled pass over the pool (PST-008)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch
from test_attention_layout import PAGE, expected, filled_store, ragged_batch
from test_paged_store import ATOL
from torch.profiler import ProfilerActivity, profile

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import StoreConfig
from pagedkv.store import decode_attention
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
def test_fused_by_default_in_16_bits_only() -> None:
    assert TorchPagedStore(StoreConfig(1, 2, 8, 4, 4, "bfloat16")).fused_decode
    assert TorchPagedStore(StoreConfig(1, 2, 8, 4, 4, "float16")).fused_decode
    assert not TorchPagedStore(StoreConfig(1, 2, 8, 4, 4)).fused_decode
    assert TorchPagedStore(StoreConfig(1, 2, 8, 4, 4), fused_decode=True).fused_decode
    assert not TorchPagedStore(
        StoreConfig(1, 2, 8, 4, 4, "bfloat16"), fused_decode=False
    ).fused_decode


@pytest.mark.spec("PST-008")
def test_without_a_compiler_the_default_gathers_and_true_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decode_attention, "can_compile", lambda: False)
    assert not decode_store("bfloat16").fused_decode
    with pytest.raises(InvalidRequest, match="C\\+\\+ compiler"):
        decode_store(fused=True)


def test_this_machine_has_the_compiler_the_fused_pass_needs() -> None:
    """The default store here is fused, so the suite checks the fused pass, not the fallback."""
    assert decode_attention.can_compile()
