"""The step's attention is laid out once and run per layer without host synchronisation
(PST-015, PST-016), for the paged store and for cache-less (v0) recomputation."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch
from test_paged_store import ATOL, batch_for, dense_reference

from pagedkv.interfaces import AttentionBatch, StoreConfig
from pagedkv.model.step_attention import RecomputeStepAttention
from pagedkv.plan import SeqChunk
from pagedkv.plan_builders import build_recompute_plan
from pagedkv.store.paged_store import PagedAttentionMetadata, TorchPagedStore
from pagedkv.store.ragged_attention import DECODE_FILL, GROUP_ROWS, plan_attention
from pagedkv.testing.tiny_qwen3 import one_torch_thread

PAGE = 4


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def filled_store(
    layers: int = 3,
    num_pages: int = 128,
    *,
    head_dim: int = 8,
    dtype: str = "float32",
    fused_decode: bool | None = None,
) -> TorchPagedStore:
    """A store of 2 KV heads whose every slot holds random K/V (stale tails included)."""
    config = StoreConfig(layers, 2, head_dim, PAGE, num_pages, dtype=dtype)
    store = TorchPagedStore(config, fused_decode=fused_decode)
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        store.key_pool(layer).copy_(torch.randn(store.key_pool(layer).shape, generator=gen))
        store.value_pool(layer).copy_(torch.randn(store.value_pool(layer).shape, generator=gen))
    return store


def ragged_batch(q_lens: list[int], contexts: list[int]) -> AttentionBatch:
    """Sequence ``b`` on its own consecutive pages."""
    tables, first = [], 0
    for context in contexts:
        pages = -(-context // PAGE)
        tables.append(tuple(range(first, first + pages)))
        first += pages
    return batch_for(tables, q_lens, contexts)


def expected(
    store: TorchPagedStore, layer: int, query: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """Dense float64 reference of every sequence, through its page table."""
    assert batch.page_tables is not None
    starts = batch.query_start.tolist()
    rows = []
    for b, context in enumerate(batch.context_lens.tolist()):
        positions = torch.arange(context)
        slots = batch.page_tables[b, positions // PAGE] * PAGE + positions % PAGE
        k, v = store.read(layer, slots)
        rows.append(dense_reference(query[starts[b] : starts[b + 1]], k, v, 0.3))
    return torch.cat(rows)


@pytest.mark.spec("PST-018")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_decode_attention_is_float32_rounded_once(dtype: str) -> None:
    """Each output element of a 16-bit decode batch is the float64 dense result rounded to the
    dtype, or one step of it away; attention computed in the 16-bit dtype lands further."""
    half = getattr(torch, dtype)
    store = TorchPagedStore(StoreConfig(1, 2, 64, PAGE, 256, dtype=dtype))
    gen = torch.Generator().manual_seed(3)
    for pool in (store.key_pool(0), store.value_pool(0)):
        pool.copy_(torch.randn(pool.shape, generator=gen) * 3)
    contexts = [150, 140, 149, 131, 147, 9, 121, 150]
    batch = ragged_batch([1] * len(contexts), contexts)
    query = (torch.randn(len(contexts), 4, 64, generator=gen) * 3).to(half)
    got = store.attention(0, query, store.prepare(batch), 0.3)
    assert got.dtype == half
    want = expected(store, 0, query.double(), batch)
    rounded = want.to(half).double()
    step = (rounded.abs() * torch.finfo(half).eps).clamp_min(torch.finfo(half).tiny)
    assert float(((got.double() - rounded).abs() / step).max()) <= 1.0


class NoHostSync:
    """Fails the test if a tensor's value is read on the host while it is active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def __enter__(self) -> None:
        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("a tensor value was read on the host")

        for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
            self.monkeypatch.setattr(torch.Tensor, name, refuse)
        for name in ("aminmax", "nonzero", "unique"):
            self.monkeypatch.setattr(torch, name, refuse)

    def __exit__(self, *exc: object) -> None:
        self.monkeypatch.undo()


@pytest.mark.spec("PST-016")
def test_write_and_attention_never_read_a_tensor_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prepare reads the batch; every layer's write and attention then run with every way of
    reading a tensor's value on the host disabled, and still give the dense result."""
    store = filled_store()
    batch = ragged_batch([1, 5, 5, 3, 1], [9, 5, 5, 11, 2])
    slots = torch.arange(100, 115)
    metadata = store.prepare(dataclasses.replace(batch, slot_mapping=slots))
    query = torch.randn(15, 4, 8)
    kv = torch.randn(15, 2, 8)
    outputs = []
    with NoHostSync(monkeypatch):
        for layer in range(3):
            store.write(layer, slots, kv, kv)
            outputs.append(store.attention(layer, query, metadata, 0.3))
    for layer, out in enumerate(outputs):
        torch.testing.assert_close(
            out.double(), expected(store, layer, query, batch), atol=ATOL, rtol=0
        )


@pytest.mark.spec("PST-016")
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is false"
)
def test_write_and_attention_do_not_synchronise_on_cuda() -> None:
    store = TorchPagedStore(StoreConfig(2, 2, 8, PAGE, 64, device="cuda"))
    batch = ragged_batch([1, 5, 3], [9, 5, 11])
    cuda = AttentionBatch(
        *(t.cuda() for t in (batch.query_start, batch.context_lens)), batch.page_tables.cuda()
    )  # type: ignore[union-attr]
    metadata = store.prepare(cuda)
    query = torch.randn(9, 4, 8, device="cuda")
    kv = torch.randn(9, 2, 8, device="cuda")
    slots = torch.arange(9, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(2):
            store.write(layer, slots, kv, kv)
            store.attention(layer, query, metadata, 0.3)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.spec("PST-016")
def test_metadata_is_immutable_and_used_in_any_order() -> None:
    store = filled_store()
    first = ragged_batch([3, 1], [7, 4])
    second = ragged_batch([2, 2, 1], [2, 6, 9])
    m1, m2 = store.prepare(first), store.prepare(second)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m1.num_slots = 0  # type: ignore[misc]
    q1, q2 = torch.randn(4, 4, 8), torch.randn(5, 4, 8)
    for layer in (2, 0, 1):
        out2 = store.attention(layer, q2, m2, 0.3)
        out1 = store.attention(layer, q1, m1, 0.3)
        torch.testing.assert_close(
            out1.double(), expected(store, layer, q1, first), atol=ATOL, rtol=0
        )
        torch.testing.assert_close(
            out2.double(), expected(store, layer, q2, second), atol=ATOL, rtol=0
        )


@pytest.mark.spec("PST-015", "PST-012")
def test_equal_shaped_chunks_share_calls_a_bounded_number_at_a_time() -> None:
    """Decode tokens of close lengths form one group (where the decode gathers: PST-017);
    prefill chunks of one shape share groups of at most GROUP_ROWS rows; other shapes run
    alone. The grouped result is the dense one."""
    q_lens = [1, 8, 8, 1, 8, 6, 8, 1, *([2] * 70)]
    contexts = [9, 8, 8, 3, 8, 12, 8, 7, *([2] * 70)]
    store = filled_store(layers=1, fused_decode=False)
    batch = ragged_batch(q_lens, contexts)
    metadata = store.prepare(batch)
    assert isinstance(metadata, PagedAttentionMetadata)
    shapes = sorted((g.num_seqs, g.q_len, g.width) for g in metadata.layout.groups)
    assert shapes == sorted(
        [
            (2, 1, 9),
            (1, 1, 3),
            (4, 8, 8),
            (1, 6, 12),
            (GROUP_ROWS // 2, 2, 2),
            (70 - GROUP_ROWS // 2, 2, 2),
        ]
    )
    query = torch.randn(sum(q_lens), 4, 8)
    out = store.attention(0, query, metadata, 0.3)
    torch.testing.assert_close(out.double(), expected(store, 0, query, batch), atol=ATOL, rtol=0)


@pytest.mark.spec("PST-015")
def test_recomputation_groups_and_matches_dense_attention() -> None:
    """The cache-less layout: each sequence attends causally to its own rows only."""
    lengths = [5, 1, 5, 3, 5]
    plan = build_recompute_plan([SeqChunk(tuple(range(n)), 0) for n in lengths])
    attention = RecomputeStepAttention.prepare(plan)
    assert sorted((g.num_seqs, g.q_len) for g in attention.layout.groups) == [
        (1, 1),
        (1, 3),
        (3, 5),
    ]
    query = torch.randn(sum(lengths), 4, 8)
    key, value = torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)
    out = attention(0, query, key, value, 0.3)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        want = dense_reference(query[rows], key[rows], value[rows], 0.3)
        torch.testing.assert_close(out[rows].double(), want, atol=ATOL, rtol=0)
        start += n


@pytest.mark.spec("PST-017")
@pytest.mark.parametrize("seed", range(5))
def test_decode_gathers_are_mostly_real_positions(seed: int) -> None:
    """However ragged the contexts, every decode group's gather is at least DECODE_FILL real
    positions, sequences of one group are within that ratio of each other, and the result is
    each sequence's dense attention."""
    rng = random.Random(seed)
    contexts = [rng.choice([1, 2, 5, 16, 17, 40, 100, 300]) + rng.randrange(3) for _ in range(24)]
    store = filled_store(layers=1, num_pages=2048, fused_decode=False)
    batch = ragged_batch([1] * len(contexts), contexts)
    metadata = store.prepare(batch)
    assert isinstance(metadata, PagedAttentionMetadata)
    groups = metadata.layout.groups
    assert sum(g.num_seqs for g in groups) == len(contexts)
    for group in groups:
        lengths = [contexts[r] for r in group.rows.tolist()]
        assert group.width == max(lengths)
        assert min(lengths) >= DECODE_FILL * max(lengths)
        assert sum(lengths) >= DECODE_FILL * group.num_seqs * max(lengths)
    query = torch.randn(len(contexts), 4, 8)
    out = store.attention(0, query, metadata, 0.3)
    torch.testing.assert_close(out.double(), expected(store, 0, query, batch), atol=ATOL, rtol=0)


@pytest.mark.spec("PST-017", "PST-009")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_kernel_reading_only_each_context_takes_every_decode_in_one_group(dtype: str) -> None:
    """Contexts from 1 to 300 (far below the gathered path's fill share of each other) beside a
    prefill chunk: the C kernel's store lays all the decodes out as one group, and each
    sequence's result is still its dense attention; the gathered store splits them."""
    contexts = [300, 1, 17, 5, 100, 2, 40, 9]
    q_lens = [1, 1, 1, 1, 4, 1, 1, 1]
    batch = ragged_batch(q_lens, contexts)
    fused = filled_store(layers=1, num_pages=256, dtype=dtype)
    assert fused._decode is not None
    assert fused._decode.reads_each_context
    metadata = fused.prepare(batch)
    assert isinstance(metadata, PagedAttentionMetadata)
    decodes = [g for g in metadata.layout.groups if g.context_lens is not None]
    assert len(decodes) == 1
    assert sorted(decodes[0].rows.tolist()) == [0, 1, 2, 3, 8, 9, 10]
    assert decodes[0].width == 300
    query = torch.randn(sum(q_lens), 4, 8).to(getattr(torch, dtype))
    out = fused.attention(0, query, metadata, 0.3)
    tolerance = ATOL if dtype == "float32" else 2e-2
    want = expected(fused, 0, query, batch)
    torch.testing.assert_close(out.double(), want, atol=tolerance, rtol=0)
    gathered = filled_store(layers=1, num_pages=256, dtype=dtype, fused_decode=False)
    split = gathered.prepare(batch)
    assert isinstance(split, PagedAttentionMetadata)
    assert len([g for g in split.layout.groups if g.context_lens is not None]) > 1


def test_plan_attention_covers_every_row_once() -> None:
    starts, contexts = [0, 1, 4, 7, 8], [5, 3, 3, 1]
    layout = plan_attention(
        starts,
        contexts,
        lambda seqs, width: torch.zeros(len(seqs), width, dtype=torch.int64),
        torch.device("cpu"),
    )
    rows = torch.cat([g.rows for g in layout.groups]).sort().values
    assert rows.tolist() == list(range(8))


@pytest.mark.spec("PST-015")
def test_a_chunk_longer_than_the_row_bound_runs_alone() -> None:
    """Equal chunks each longer than ``group_rows`` share no call: one call per chunk."""
    starts, contexts = [0, 8, 16], [8, 8]
    layout = plan_attention(
        starts,
        contexts,
        lambda seqs, width: torch.zeros(len(seqs), width, dtype=torch.int64),
        torch.device("cpu"),
        group_rows=4,
    )
    assert [g.num_seqs for g in layout.groups] == [1, 1]


@pytest.mark.spec("PST-015", "PST-017")
def test_a_context_exactly_at_the_fill_share_joins_the_longer_group() -> None:
    """PST-017 lets a decode context of exactly ``DECODE_FILL`` of the group's longest share
    its call, so it does (PST-015: as few calls as PST-017 allows); one below starts a group."""
    longest, at_fill, below = 10, 7, 6
    assert at_fill == DECODE_FILL * longest  # the boundary, exact in floating point
    contexts = [at_fill, longest, below]
    store = filled_store(layers=1, fused_decode=False)
    batch = ragged_batch([1, 1, 1], contexts)
    metadata = store.prepare(batch)
    assert isinstance(metadata, PagedAttentionMetadata)
    groups = sorted(g.rows.tolist() for g in metadata.layout.groups)
    assert groups == [[0, 1], [2]]
    query = torch.randn(len(contexts), 4, 8)
    out = store.attention(0, query, metadata, 0.3)
    torch.testing.assert_close(out.double(), expected(store, 0, query, batch), atol=ATOL, rtol=0)


@pytest.mark.spec("PST-040")
def test_every_tensor_of_the_layout_lies_on_the_given_device() -> None:
    """``meta`` stands in for an accelerator (a device other than the CPU): the rows, gather
    indices and masks of decode groups, whole chunks and continuing chunks all lie on the
    device the layout is planned for, none on the host (the indices are built on the host and
    moved in one copy, PST-054)."""
    meta = torch.device("meta")
    starts, contexts = [0, 1, 4, 7, 8, 12, 16, 17], [5, 3, 3, 4, 4, 9, 1]
    layout = plan_attention(
        starts,
        contexts,
        lambda seqs, width: torch.zeros(len(seqs), width, dtype=torch.int64),
        meta,
    )
    kinds = {(g.q_len == 1, g.mask is None) for g in layout.groups}
    # Every kind of group: padded and unpadded decode groups, whole and continuing chunks.
    assert kinds == {(True, False), (True, True), (False, True), (False, False)}
    for group in layout.groups:
        assert group.rows.device == meta
        assert group.kv_index.device == meta
        assert group.mask is None or group.mask.device == meta


def test_a_group_asks_for_a_mask_or_for_causal_masking_never_both() -> None:
    """scaled_dot_product_attention documents an error when both ``attn_mask`` and
    ``is_causal`` are set: a whole chunk is plain causal with no mask, a continuing chunk and
    a padded decode group carry their mask and are not ``is_causal``, and a decode group whose
    contexts all equal its width needs neither."""
    # A whole chunk, a continuing one, two decodes padded to 6, one alone.
    starts, contexts = [0, 4, 7, 8, 9, 10], [4, 5, 6, 5, 2]
    layout = plan_attention(
        starts,
        contexts,
        lambda seqs, width: torch.zeros(len(seqs), width, dtype=torch.int64),
        torch.device("cpu"),
    )
    kinds = sorted((g.q_len, g.width, g.is_causal, g.mask is None) for g in layout.groups)
    assert kinds == [
        (1, 2, False, True),
        (1, 6, False, False),
        (3, 5, False, False),
        (4, 4, True, True),
    ]
