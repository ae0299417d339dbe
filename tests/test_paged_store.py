"""TorchPagedStore: preallocated pools, exact write/read, paged attention == dense attention.

Page tables come from the ReferenceKVManager, so pages are freed and handed to other sequences
as they would be in the engine. Attention is checked against a float64 dense reference over
each sequence's logical K/V (tolerance ``ATOL`` on float32 outputs, see PST-010).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._inductor.utils import run_and_get_code

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch, KVManagerConfig, PagedStore, StoreConfig
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.store.paged_store import (
    TorchPagedStore,
    bytes_per_page,
    pages_for_budget,
    torch_device,
)
from pagedkv.testing.tiny_qwen3 import one_torch_thread
from pagedkv_conformance.store_harness import ATOL, dense_reference


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and much faster on a loaded machine."""
    with one_torch_thread():
        yield


def make_store(
    page_size: int = 4,
    num_pages: int = 16,
    kv_heads: int = 2,
    head_dim: int = 8,
    layers: int = 2,
) -> TorchPagedStore:
    return TorchPagedStore(
        StoreConfig(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            num_pages=num_pages,
        )
    )


def batch_for(
    page_tables: list[tuple[int, ...]], q_lens: list[int], context_lens: list[int]
) -> AttentionBatch:
    width = max(len(p) for p in page_tables)
    padded = [list(p) + [0] * (width - len(p)) for p in page_tables]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionBatch(
        query_start=torch.tensor(starts, dtype=torch.int64),
        context_lens=torch.tensor(context_lens, dtype=torch.int64),
        page_tables=torch.tensor(padded, dtype=torch.int64),
    )


@dataclass
class Harness:
    """A manager, a store and the logical K/V every live sequence should have."""

    store: TorchPagedStore
    manager: ReferenceKVManager
    generator: torch.Generator
    keys: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # per layer [n, KV, D]
    values: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def create(cls, page_size: int, num_pages: int, kv_heads: int, head_dim: int) -> Harness:
        store = make_store(page_size, num_pages, kv_heads, head_dim)
        manager = ReferenceKVManager(
            KVManagerConfig(num_pages, page_size, enable_prefix_caching=False)
        )
        return cls(store, manager, torch.Generator().manual_seed(0))

    def length(self, seq: int) -> int:
        return int(self.keys[seq][0].shape[0])

    def extend(self, seq: int, count: int) -> None:
        """Reserve ``count`` more positions for ``seq`` (opening it if new) and write them."""
        cfg = self.store.config
        start = self.length(seq) if seq in self.keys else 0
        if seq in self.keys:
            table = self.manager.grow(seq, start + count)
        else:
            table = self.manager.allocate(seq, [1] * count, count).page_table
            empty = torch.empty(0, cfg.num_kv_heads, cfg.head_dim)
            self.keys[seq] = [empty] * cfg.num_layers
            self.values[seq] = [empty] * cfg.num_layers
        slots = torch.tensor(table.slots(start, start + count), dtype=torch.int64)
        for layer in range(cfg.num_layers):
            shape = (count, cfg.num_kv_heads, cfg.head_dim)
            k = torch.randn(shape, generator=self.generator)
            v = torch.randn(shape, generator=self.generator)
            self.store.write(layer, slots, k, v)
            self.keys[seq][layer] = torch.cat([self.keys[seq][layer], k])
            self.values[seq][layer] = torch.cat([self.values[seq][layer], v])

    def free(self, seq: int) -> None:
        self.manager.free(seq)
        del self.keys[seq], self.values[seq]

    def all_slots(self, seq: int) -> torch.Tensor:
        table = self.manager.page_table(seq)
        return torch.tensor(table.slots(0, self.length(seq)), dtype=torch.int64)

    def check_read(self) -> None:
        for seq in self.keys:
            for layer in range(self.store.config.num_layers):
                k, v = self.store.read(layer, self.all_slots(seq))
                assert torch.equal(k, self.keys[seq][layer])
                assert torch.equal(v, self.values[seq][layer])

    def check_attention(self, seqs: list[int], q_lens: list[int], heads: int) -> None:
        cfg = self.store.config
        tables = [self.manager.page_table(s).pages for s in seqs]
        contexts = [self.length(s) for s in seqs]
        batch = batch_for(tables, q_lens, contexts)
        query = torch.randn(sum(q_lens), heads, cfg.head_dim, generator=self.generator)
        scale = 0.3  # not head_dim ** -0.5: the scale given must be the one used
        for layer in range(cfg.num_layers):
            out = self.store.attention(layer, query, self.store.prepare(batch), scale)
            assert out.shape == query.shape
            row = 0
            for seq, q_len in zip(seqs, q_lens, strict=True):
                expected = dense_reference(
                    query[row : row + q_len],
                    self.keys[seq][layer],
                    self.values[seq][layer],
                    scale,
                )
                torch.testing.assert_close(
                    out[row : row + q_len].double(), expected, atol=ATOL, rtol=0
                )
                row += q_len


# -- construction and sizing ---------------------------------------------------------------


@pytest.mark.spec("PST-001")
def test_pools_are_preallocated_once_and_never_reallocated() -> None:
    harness = Harness.create(page_size=4, num_pages=8, kv_heads=2, head_dim=8)
    store = harness.store
    pools = [store.key_pool(0), store.value_pool(1)]
    pointers = [p.data_ptr() for p in pools]
    assert tuple(pools[0].shape) == (8, 4, 2, 8)
    assert store.nbytes == 8 * bytes_per_page(store.config)
    harness.extend(0, 11)
    harness.extend(1, 3)
    harness.check_attention([0, 1], [4, 1], heads=4)
    assert [store.key_pool(0).data_ptr(), store.value_pool(1).data_ptr()] == pointers
    assert store.nbytes == 8 * bytes_per_page(store.config)


@pytest.mark.spec("PST-007")
def test_every_pool_is_a_tensor_of_its_own() -> None:
    store = make_store(layers=3)
    pools = [store.key_pool(layer) for layer in range(3)]
    pools += [store.value_pool(layer) for layer in range(3)]
    for pool in pools:
        assert pool.untyped_storage().nbytes() == pool.numel() * pool.element_size()
    assert len({pool.untyped_storage().data_ptr() for pool in pools}) == len(pools)


@pytest.mark.spec("PST-007")
def test_a_compiled_write_copies_no_pool() -> None:
    """Inductor's code for a write allocates nothing as large as a pool: the write is in place,
    not a scatter into a copy of the tensor behind the pool."""
    store = make_store(page_size=4, num_pages=64, kv_heads=2, head_dim=8, layers=2)
    pool_numel = store.key_pool(1).numel()
    slots = torch.tensor([5, 9, 200])
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)

    def write(k: torch.Tensor, v: torch.Tensor) -> None:
        store.write(1, slots, k, v)

    torch._dynamo.reset()  # type: ignore[no-untyped-call]
    _, sources = run_and_get_code(torch.compile(write, backend="inductor"), key, value)
    shapes = [
        [int(n) for n in shape.split(",") if n.strip()]
        for source in sources
        for shape in re.findall(r"empty_strided\w*\(\(([\d, ]*)\)", source)
    ]
    assert all(math.prod(shape) < pool_numel for shape in shapes), shapes
    assert torch.equal(store.read(1, slots)[0], key)
    assert torch.equal(store.read(1, slots)[1], value)
    assert not store.key_pool(0).any()
    assert not store.value_pool(0).any()


@pytest.mark.spec("PST-002")
def test_sizing_from_a_byte_budget() -> None:
    config = StoreConfig(
        num_layers=3, num_kv_heads=2, head_dim=8, page_size=16, num_pages=1, dtype="bfloat16"
    )
    per_page = bytes_per_page(config)
    assert per_page == 2 * 3 * 16 * 2 * 8 * 2
    assert pages_for_budget(config, 10 * per_page + per_page - 1) == 10
    store = TorchPagedStore.from_budget(config, 5 * per_page)
    assert store.config.num_pages == 5
    assert store.nbytes == 5 * per_page
    assert store.key_pool(0).dtype == torch.bfloat16
    with pytest.raises(InvalidRequest, match="budget"):
        pages_for_budget(config, per_page - 1)


@pytest.mark.spec("PST-003")
def test_invalid_configs_and_arguments_raise_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="num_pages"):
        make_store(num_pages=0)
    with pytest.raises(InvalidRequest, match="dtype"):
        TorchPagedStore(StoreConfig(1, 1, 8, 4, 4, dtype="int8"))
    store = make_store(page_size=4, num_pages=4)
    kv = torch.zeros(2, 2, 8)
    with pytest.raises(InvalidRequest, match="layer"):
        store.write(2, torch.tensor([0, 1]), kv, kv)
    with pytest.raises(InvalidRequest, match="slots"):
        store.write(0, torch.tensor([0, 16]), kv, kv)
    with pytest.raises(InvalidRequest, match="key"):
        store.write(0, torch.tensor([0, 1]), torch.zeros(2, 2, 4), kv)
    with pytest.raises(InvalidRequest, match="slots"):
        store.read(0, torch.tensor([-1]))
    query = torch.zeros(3, 4, 8)
    with pytest.raises(InvalidRequest, match="page tables"):
        store.prepare(AttentionBatch(torch.tensor([0, 3]), torch.tensor([3]), None))
    with pytest.raises(InvalidRequest, match="context_len"):
        store.prepare(batch_for([(0,)], [3], [5]))
    with pytest.raises(InvalidRequest, match="pages"):
        store.prepare(batch_for([(7,)], [3], [3]))
    with pytest.raises(InvalidRequest, match="slots"):
        store.prepare(
            dataclasses.replace(batch_for([(0,)], [3], [3]), slot_mapping=torch.tensor([0, 1, 16]))
        )
    with pytest.raises(InvalidRequest, match="slots"):
        store.prepare(
            dataclasses.replace(batch_for([(0,)], [3], [3]), slot_mapping=torch.tensor([0, 1]))
        )
    metadata = store.prepare(batch_for([(0,)], [3], [3]))
    with pytest.raises(InvalidRequest, match="num_kv_heads"):
        store.attention(0, torch.zeros(3, 3, 8), metadata, 1.0)
    with pytest.raises(InvalidRequest, match="rows"):
        store.attention(0, torch.zeros(4, 4, 8), metadata, 1.0)
    with pytest.raises(InvalidRequest, match="layer"):
        store.attention(2, query, metadata, 1.0)
    other = make_store(page_size=4, num_pages=5)
    with pytest.raises(InvalidRequest, match="prepared"):
        other.attention(0, query, metadata, 1.0)


@pytest.mark.spec("PST-001")
def test_satisfies_the_paged_store_protocol() -> None:
    assert isinstance(make_store(), PagedStore)


# -- write / read ------------------------------------------------------------------------------


@pytest.mark.spec("PST-004")
def test_write_then_read_returns_exactly_what_was_written() -> None:
    store = make_store(page_size=3, num_pages=5)
    slots = torch.tensor([14, 0, 7, 3])
    k = torch.randn(4, 2, 8)
    v = torch.randn(4, 2, 8)
    store.write(1, slots, k, v)
    got_k, got_v = store.read(1, slots)
    assert torch.equal(got_k, k)
    assert torch.equal(got_v, v)
    assert torch.equal(store.key_pool(1)[14 // 3, 14 % 3], k[0])
    # the other layer is untouched
    assert not store.read(0, slots)[0].any()


@pytest.mark.spec("PST-030")
def test_write_touches_only_the_given_slots() -> None:
    store = make_store(page_size=4, num_pages=6)
    for layer in range(2):
        store.key_pool(layer).normal_()
        store.value_pool(layer).normal_()
    before = [(store.key_pool(i).clone(), store.value_pool(i).clone()) for i in range(2)]
    slots = torch.tensor([2, 9, 23])
    store.write(1, slots, torch.ones(3, 2, 8), torch.ones(3, 2, 8))
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(store.key_pool(0), before[0][0])
    assert torch.equal(store.value_pool(0), before[0][1])
    assert torch.equal(
        store.key_pool(1).view(24, 2, 8)[untouched], before[1][0].view(24, 2, 8)[untouched]
    )
    assert torch.equal(
        store.value_pool(1).view(24, 2, 8)[untouched], before[1][1].view(24, 2, 8)[untouched]
    )


@pytest.mark.spec("PST-020")
def test_any_split_of_the_pool_between_sequences_works() -> None:
    """No per-sequence cap: one sequence may hold the whole pool, or many hold a page each."""
    whole = Harness.create(page_size=4, num_pages=8, kv_heads=2, head_dim=8)
    whole.extend(0, 32)
    whole.check_attention([0], [32], heads=4)
    whole.check_attention([0], [1], heads=4)
    split = Harness.create(page_size=4, num_pages=8, kv_heads=2, head_dim=8)
    for seq in range(8):
        split.extend(seq, 1 + seq % 4)
    split.check_attention(list(range(8)), [1] * 8, heads=4)
    split.check_attention(list(range(8)), [1 + seq % 4 for seq in range(8)], heads=4)
    assert whole.store.nbytes == split.store.nbytes == 8 * bytes_per_page(whole.store.config)


@pytest.mark.spec("PST-005")
def test_write_casts_to_the_pool_dtype_and_detaches() -> None:
    store = TorchPagedStore(StoreConfig(1, 1, 4, 2, 2, dtype="bfloat16"))
    k = torch.randn(2, 1, 4, requires_grad=True)
    store.write(0, torch.tensor([1, 2]), k, k * 2)
    got_k, got_v = store.read(0, torch.tensor([1, 2]))
    assert got_k.dtype == torch.bfloat16
    assert not got_k.requires_grad
    assert torch.equal(got_k, k.detach().to(torch.bfloat16))
    assert torch.equal(got_v, (k.detach() * 2).to(torch.bfloat16))


# -- attention -------------------------------------------------------------------------------


@pytest.mark.spec("PST-010", "PST-011", "PST-012")
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_ragged_batch_of_prefill_chunks_and_decode_tokens(page_size: int) -> None:
    harness = Harness.create(page_size=page_size, num_pages=64, kv_heads=2, head_dim=8)
    for seq, length in enumerate([1, 7, 23, 16, 5]):
        harness.extend(seq, length)
    # seq 0: its whole 1-token context; seq 1: a 3-token chunk; seq 2: one decode token;
    # seq 3: a full prefill; seq 4: one decode token.
    harness.check_attention([0, 1, 2, 3, 4], [1, 3, 1, 16, 1], heads=4)
    harness.check_attention([2, 4], [1, 1], heads=4)  # all-decode batch
    harness.check_attention([1, 3], [7, 9], heads=8)  # GQA 4:1


@pytest.mark.spec("PST-011")
def test_causal_masking_within_a_chunk_is_exact() -> None:
    """Changing a later position's K/V must not change an earlier row's output at all."""
    store = make_store(page_size=4, num_pages=4, kv_heads=1, head_dim=8, layers=1)
    slots = torch.arange(10)
    k, v = torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    store.write(0, slots, k, v)
    batch = batch_for([(0, 1, 2)], [6], [10])  # rows = positions 4..9
    query = torch.randn(6, 2, 8)
    metadata = store.prepare(batch)
    before = store.attention(0, query, metadata, 0.3)
    store.write(0, torch.tensor([9]), torch.full((1, 1, 8), 1e4), torch.full((1, 1, 8), 1e4))
    after = store.attention(0, query, metadata, 0.3)
    assert torch.equal(before[:5], after[:5])
    assert not torch.equal(before[5], after[5])


@pytest.mark.spec("PST-013")
def test_stale_and_non_finite_slot_contents_outside_the_context_never_leak() -> None:
    harness = Harness.create(page_size=4, num_pages=12, kv_heads=2, head_dim=8)
    # poison the whole pool first: every slot a sequence has not written holds NaN
    for layer in range(2):
        harness.store.key_pool(layer).fill_(math.nan)
        harness.store.value_pool(layer).fill_(math.inf)
    for seq, length in enumerate([6, 1, 9]):
        harness.extend(seq, length)
    harness.check_attention([0, 1, 2], [1, 1, 1], heads=4)  # padded decode gather
    harness.check_attention([0, 1, 2], [2, 1, 9], heads=4)


@pytest.mark.spec("PST-014")
def test_result_is_independent_of_which_physical_pages_hold_the_sequence() -> None:
    """The same logical K/V, placed on other pages after frees and reuse, attend the same."""
    cfg = StoreConfig(num_layers=1, num_kv_heads=2, head_dim=8, page_size=3, num_pages=10)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(8, 2, 8, generator=gen), torch.randn(8, 2, 8, generator=gen)
    query = torch.randn(3, 4, 8, generator=gen)
    outputs = []
    for pages in [(0, 1, 2), (9, 4, 6), (5, 3, 8)]:
        store = TorchPagedStore(cfg)
        slots = torch.tensor([pages[p // 3] * 3 + p % 3 for p in range(8)])
        store.write(0, slots, k, v)
        outputs.append(store.attention(0, query, store.prepare(batch_for([pages], [3], [8])), 0.25))
    torch.testing.assert_close(outputs[1], outputs[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[2], outputs[0], atol=ATOL, rtol=0)


@pytest.mark.spec("PST-014", "PST-030")
def test_pages_freed_by_one_sequence_serve_another() -> None:
    """A pool exactly full: the second sequence can only get the first one's freed pages."""
    harness = Harness.create(page_size=4, num_pages=3, kv_heads=2, head_dim=8)
    harness.extend(0, 12)
    first_pages = set(harness.manager.page_table(0).pages)
    harness.free(0)
    harness.extend(1, 6)  # its second page keeps two stale positions of sequence 0
    harness.extend(2, 3)
    reused = set(harness.manager.page_table(1).pages) | set(harness.manager.page_table(2).pages)
    assert reused == first_pages
    harness.check_read()
    harness.check_attention([1, 2], [6, 1], heads=4)
    harness.check_attention([1, 2], [1, 1], heads=4)


@st.composite
def programs(draw: st.DrawFn) -> tuple[int, int, int, list[tuple[str, int, int]]]:
    """A pool shape and a list of (op, seq, count) with op in allocate/grow/free."""
    page_size = draw(st.sampled_from([1, 2, 3, 5, 16]))
    kv_heads = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 4]))
    ops: list[tuple[str, int, int]] = []
    for _ in range(draw(st.integers(1, 12))):
        ops.append(
            (
                draw(st.sampled_from(["extend", "extend", "free"])),
                draw(st.integers(0, 4)),
                draw(st.integers(1, 12)),
            )
        )
    return page_size, kv_heads, groups, ops


@pytest.mark.spec("PST-004", "PST-010", "PST-011", "PST-012", "PST-014", "PST-030")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), data=st.data())
def test_random_programs_match_the_dense_reference(
    program: tuple[int, int, int, list[tuple[str, int, int]]], data: st.DataObject
) -> None:
    page_size, kv_heads, groups, ops = program
    # a pool barely larger than the live tokens, so freed pages are reused by other sequences
    num_pages = max(4, 40 // page_size + 2)
    harness = Harness.create(page_size, num_pages, kv_heads, head_dim=8)
    for op, seq, count in ops:
        if op == "free":
            if seq in harness.keys:
                harness.free(seq)
            continue
        length = harness.length(seq) if seq in harness.keys else 0
        pages_needed = -(-(length + count) // page_size) - -(-length // page_size)
        if length + count > 40 or pages_needed > harness.manager.stats().pages_free:
            continue
        harness.extend(seq, count)
    harness.check_read()
    if not harness.keys:
        return
    seqs = sorted(harness.keys)
    q_lens = [
        data.draw(st.one_of(st.just(1), st.integers(1, harness.length(s))), label=f"q_len {s}")
        for s in seqs
    ]
    harness.check_attention(seqs, q_lens, heads=kv_heads * groups)


@pytest.mark.spec("PST-002")
def test_a_budget_of_exactly_one_page_buys_one_page() -> None:
    config = StoreConfig(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, num_pages=9)
    per_page = bytes_per_page(config)
    assert pages_for_budget(config, per_page) == 1
    assert TorchPagedStore.from_budget(config, 2 * per_page - 1).config.num_pages == 1


@pytest.mark.spec("PST-003")
def test_devices_are_checked_when_the_store_is_built() -> None:
    with pytest.raises(InvalidRequest, match="device"):
        torch_device("not-a-device")
    assert torch_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequest, match="CUDA"):
            TorchPagedStore(StoreConfig(1, 1, 4, 2, 2, device="cuda"))


@pytest.mark.spec("PST-040")
def test_the_pools_live_on_the_configured_device_and_host_slots_are_moved_there() -> None:
    """``meta`` stands in for an accelerator: a device other than the CPU, tensors without
    data. The pools are allocated there, and a write given host slots moves them there
    (indexing a meta pool with host slots raises)."""
    store = TorchPagedStore(StoreConfig(2, 2, 8, 4, 4, device="meta"))
    for layer in range(2):
        assert store.key_pool(layer).device == torch.device("meta")
        assert store.value_pool(layer).device == torch.device("meta")
    kv = torch.empty(3, 2, 8, device="meta")
    store.write(1, torch.tensor([0, 5, 9]), kv, kv)
    store.write(0, torch.tensor([1, 2, 3], dtype=torch.int32), kv, kv)


@pytest.mark.spec("PST-010")
def test_a_bfloat16_pool_attends_a_float32_query_in_float32() -> None:
    """K/V are cast to the query's dtype: the result is float32 and close to the reference
    computed on the bfloat16-rounded K/V."""
    store = TorchPagedStore(StoreConfig(1, 2, 8, 4, 4, dtype="bfloat16"))
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    store.write(0, torch.arange(6), k, v)
    query = torch.randn(2, 4, 8, generator=gen)
    for q_lens in ([2], [1]):
        batch = batch_for([(0, 1)], q_lens, [6])
        out = store.attention(0, query[: q_lens[0]], store.prepare(batch), 0.3)
        assert out.dtype == torch.float32
        want = dense_reference(query[: q_lens[0]], k.bfloat16(), v.bfloat16(), 0.3)
        torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=0)
