"""PagedStore conformance tests (specs/paged-store.md), run against the backend's own
``create_paged_store``.

Every test goes through the PagedStore Protocol (``write``, ``read``, ``attention`` through
:func:`~pagedkv_conformance.store_harness.attend`) and checks attention against a dense float64
reference computed here. Sequences sit on pages the test chooses: shuffled, recycled from other
sequences, next to pages and page-table padding full of NaN and infinities.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch, PagedStore

from .loading import MakePagedStore
from .store_harness import ATOL, SCALE, Sequences, attend, dense_reference, make_batch, slots_of


def sequences(store: PagedStore, seed: int = 0) -> Sequences:
    return Sequences(store, torch.Generator().manual_seed(seed))


def poison(store: PagedStore) -> None:
    """Fill every slot of every layer with NaN keys and infinite values."""
    cfg = store.config
    slots = torch.arange(cfg.num_pages * cfg.page_size)
    shape = (len(slots), cfg.num_kv_heads, cfg.head_dim)
    for layer in range(cfg.num_layers):
        store.write(
            layer,
            slots.to(cfg.device),
            torch.full(shape, math.nan).to(cfg.device),
            torch.full(shape, math.inf).to(cfg.device),
        )


@pytest.mark.requires("paged_store")
class PagedStoreSuite:
    """specs/paged-store.md through the Protocol."""

    # -- write / read ----------------------------------------------------------------------

    @pytest.mark.spec("PST-004", "PST-030")
    def test_read_returns_exactly_the_last_write(self, make_paged_store: MakePagedStore) -> None:
        """Writes to scattered slots of two layers, some overwritten: every slot reads back
        bit for bit what was written there last, and slots never written keep their value."""
        store = make_paged_store(page_size=3, num_pages=6)
        gen = torch.Generator().manual_seed(3)
        everything = torch.arange(18)
        base = [torch.randn(18, 2, 8, generator=gen) for _ in range(4)]
        for layer in range(2):
            store.write(layer, everything, base[2 * layer], base[2 * layer + 1])
        slots = torch.tensor([14, 0, 7, 3, 9])
        k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
        store.write(1, slots, k, v)
        again = torch.tensor([7, 17])
        k2, v2 = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
        store.write(1, again, k2, v2)
        want_k, want_v = base[2].clone(), base[3].clone()
        want_k[slots], want_v[slots] = k, v
        want_k[again], want_v[again] = k2, v2
        got_k, got_v = store.read(1, everything)
        assert torch.equal(got_k, want_k)
        assert torch.equal(got_v, want_v)
        untouched_k, untouched_v = store.read(0, everything)
        assert torch.equal(untouched_k, base[0])
        assert torch.equal(untouched_v, base[1])
        shuffled = torch.tensor([17, 3, 14])
        assert torch.equal(store.read(1, shuffled)[0], want_k[shuffled])

    @pytest.mark.spec("PST-005")
    def test_write_casts_to_the_pool_dtype_and_detaches(
        self, make_paged_store: MakePagedStore
    ) -> None:
        store = make_paged_store(
            num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, num_pages=2, dtype="bfloat16"
        )
        k = torch.randn(2, 1, 4, requires_grad=True)
        store.write(0, torch.tensor([1, 2]), k, k * 2)
        got_k, got_v = store.read(0, torch.tensor([1, 2]))
        assert got_k.dtype == torch.bfloat16
        assert not got_k.requires_grad
        assert not got_v.requires_grad
        assert torch.equal(got_k, k.detach().to(torch.bfloat16))
        assert torch.equal(got_v, (k.detach() * 2).to(torch.bfloat16))

    @pytest.mark.spec("PST-003")
    def test_invalid_configs_and_arguments_raise_invalid_request(
        self, make_paged_store: MakePagedStore
    ) -> None:
        for bad in ({"num_pages": 0}, {"page_size": 0}, {"num_layers": 0}, {"dtype": "int8"}):
            with pytest.raises(InvalidRequest):
                make_paged_store(**bad)
        store = make_paged_store(page_size=4, num_pages=4)
        kv = torch.zeros(2, 2, 8)
        with pytest.raises(InvalidRequest):
            store.write(2, torch.tensor([0, 1]), kv, kv)
        with pytest.raises(InvalidRequest):
            store.write(0, torch.tensor([0, 16]), kv, kv)
        with pytest.raises(InvalidRequest):
            store.write(0, torch.tensor([0, 1]), torch.zeros(2, 2, 4), kv)
        with pytest.raises(InvalidRequest):
            store.read(0, torch.tensor([-1]))
        with pytest.raises(InvalidRequest):
            store.read(-1, torch.tensor([0]))
        query = torch.zeros(3, 4, 8)  # three rows, four heads
        for shape in ((3, 4, 4), (3, 32)):  # another head size; no head dimension
            with pytest.raises(InvalidRequest):
                attend(store, 0, torch.zeros(shape), make_batch([(0,)], [3], [3]), 1.0)
        with pytest.raises(InvalidRequest):  # three heads: not a multiple of two KV heads
            attend(store, 0, torch.zeros(3, 3, 8), make_batch([(0,)], [3], [3]), 1.0)
        with pytest.raises(InvalidRequest):  # no layer 5
            attend(store, 5, query, make_batch([(0,)], [3], [3]), 1.0)

    @pytest.mark.spec("PST-003")
    @pytest.mark.parametrize(
        ("rows", "batch"),
        [
            pytest.param(
                3,
                lambda: AttentionBatch(torch.tensor([0, 3]), torch.tensor([3]), None),
                id="no-page-tables",
            ),
            pytest.param(3, lambda: make_batch([(0,)], [3], [5]), id="context-past-page-table"),
            pytest.param(3, lambda: make_batch([(4,)], [3], [3]), id="page-past-the-pool"),
            pytest.param(3, lambda: make_batch([(-1,)], [3], [3]), id="negative-page"),
            pytest.param(3, lambda: make_batch([(0,)], [3], [2]), id="more-rows-than-context"),
            pytest.param(3, lambda: make_batch([(0,)], [2], [2]), id="offsets-for-fewer-rows"),
            pytest.param(
                4,
                lambda: AttentionBatch(
                    torch.tensor([1, 4]), torch.tensor([3]), torch.tensor([[0]])
                ),
                id="offsets-not-from-zero",
            ),
            pytest.param(
                3,
                lambda: AttentionBatch(
                    torch.tensor([0, 3]), torch.tensor([3]), torch.tensor([[0], [1]])
                ),
                id="page-tables-of-another-batch",
            ),
        ],
    )
    def test_inconsistent_batches_raise_invalid_request(
        self,
        make_paged_store: MakePagedStore,
        rows: int,
        batch: Callable[[], AttentionBatch],
    ) -> None:
        """A query against a batch that does not describe it, or names pages outside the
        pool of 4 pages."""
        store = make_paged_store(page_size=4, num_pages=4)
        with pytest.raises(InvalidRequest):
            attend(store, 0, torch.zeros(rows, 4, 8), batch(), 1.0)

    @pytest.mark.spec("PST-003", "PST-004")
    def test_slots_must_be_integers_of_any_width(self, make_paged_store: MakePagedStore) -> None:
        """Float, boolean or 2-D slots raise; int32 slots work like int64 ones."""
        store = make_paged_store(page_size=4, num_pages=4)
        kv = torch.randn(2, 2, 8)
        for bad in (torch.tensor([0.0, 1.0]), torch.tensor([True, False]), torch.tensor([[0, 1]])):
            with pytest.raises(InvalidRequest):
                store.write(0, bad, kv, kv)
            with pytest.raises(InvalidRequest):
                store.read(0, bad)
        narrow = torch.tensor([5, 2], dtype=torch.int32)
        store.write(1, narrow, kv, kv * 2)
        got_k, got_v = store.read(1, narrow)
        assert torch.equal(got_k, kv)
        assert torch.equal(got_v, kv * 2)
        assert torch.equal(store.read(1, torch.tensor([2]))[0], kv[1:])

    @pytest.mark.spec("PST-006")
    def test_copy_pages_copies_every_layer_and_nothing_else(
        self, make_paged_store: MakePagedStore
    ) -> None:
        """Every slot of three layers holds distinct K/V; copying pages 1 and 4 onto 3 and 0
        makes those hold, bit for bit in every layer, what the sources held, and leaves every
        other page as it was; copies that name pages badly (lengths that differ, a page
        outside the pool, a target twice or among the sources) raise and change nothing."""
        store = make_paged_store(num_layers=3, page_size=4, num_pages=6)
        slots = torch.arange(24)
        gen = torch.Generator().manual_seed(6)
        for layer in range(3):
            store.write(
                layer,
                slots,
                torch.randn(24, 2, 8, generator=gen),
                torch.randn(24, 2, 8, generator=gen),
            )

        def pages() -> list[tuple[torch.Tensor, torch.Tensor]]:
            reads = [store.read(layer, slots) for layer in range(3)]
            key = torch.stack([k for k, _ in reads]).reshape(3, 6, 4, 2, 8)
            value = torch.stack([v for _, v in reads]).reshape(3, 6, 4, 2, 8)
            return [(key[:, p], value[:, p]) for p in range(6)]

        before = pages()
        store.copy_pages(torch.tensor([1, 4]), torch.tensor([3, 0]))
        after = pages()
        sources = {3: 1, 0: 4}
        for page in range(6):
            want = before[sources.get(page, page)]
            assert torch.equal(after[page][0], want[0]), f"page {page}: K"
            assert torch.equal(after[page][1], want[1]), f"page {page}: V"
        for src, dst in (([1, 2], [3]), ([6], [0]), ([0], [-1]), ([1, 2], [3, 3]), ([1], [1])):
            with pytest.raises(InvalidRequest):
                store.copy_pages(torch.tensor(src), torch.tensor(dst))
            again = pages()
            assert all(
                torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                for a, b in zip(again, after, strict=True)
            ), f"copy_pages({src}, {dst}) raised but changed pages"

    # -- attention ---------------------------------------------------------------------------

    @pytest.mark.spec("PST-010", "PST-012", "PST-014")
    @pytest.mark.parametrize("page_size", [1, 3, 16])
    def test_ragged_batch_on_shuffled_pages_matches_the_dense_reference(
        self, make_paged_store: MakePagedStore, page_size: int
    ) -> None:
        """Sequences on shuffled, non-contiguous pages; one batch mixes a whole-context
        prefill, continuing chunks over cached context, and decode rows."""
        lengths = [1, 7, 23, 16, 5, 12]
        needed = [-(-n // page_size) for n in lengths]
        num_pages = sum(needed) + 3
        store = make_paged_store(page_size=page_size, num_pages=num_pages)
        seqs = sequences(store, seed=page_size)
        pool = list(range(num_pages))
        random.Random(page_size).shuffle(pool)
        for seq, (length, count) in enumerate(zip(lengths, needed, strict=True)):
            seqs.place(seq, pool[:count], length)
            del pool[:count]
        # whole 1-token context; a 3-row continuing chunk; decode; a whole prefill;
        # decode; a 7-row continuing chunk
        seqs.check([0, 1, 2, 3, 4, 5], [1, 3, 1, 16, 1, 7], heads=4)
        seqs.check([2, 4, 1], [1, 1, 1], heads=4)  # all decode
        seqs.check([5, 2], [11, 22], heads=8)  # GQA 4:1, long continuing chunks

    @pytest.mark.spec("PST-011")
    def test_causal_mask_of_a_continuing_chunk_is_exact(
        self, make_paged_store: MakePagedStore
    ) -> None:
        """Rows of a chunk that continues 7 cached positions: changing the K/V of a position
        leaves every earlier row bit for bit unchanged and changes the rows that see it."""
        store = make_paged_store(num_layers=1, num_kv_heads=1, page_size=4, num_pages=6)
        seqs = sequences(store, seed=11)
        seqs.place(0, [4, 1, 5], 12)  # rows = positions 7..11
        seqs.place(1, [0, 2], 6)
        query = seqs.query(5 + 2, heads=2)
        before = seqs.attend(0, [0, 1], [5, 2], query)
        torch.testing.assert_close(
            before.double(), seqs.expected(0, [0, 1], [5, 2], query), atol=ATOL, rtol=0
        )
        changed = 9  # seen by rows 9, 10, 11 (chunk rows 2, 3, 4), not by rows 7, 8
        slot = slots_of(seqs.pages[0], 4, 12)[changed : changed + 1]
        store.write(0, slot, torch.full((1, 1, 8), 30.0), torch.full((1, 1, 8), 1e3))
        after = seqs.attend(0, [0, 1], [5, 2], query)
        assert torch.equal(before[:2], after[:2]), "a row saw a later position"
        assert torch.equal(before[5:], after[5:]), "another sequence saw this one's K/V"
        for row in (2, 3, 4):
            assert not torch.equal(before[row], after[row]), f"row {row} missed position 9"

    @pytest.mark.spec("PST-013")
    def test_nan_and_inf_outside_every_context_never_leak(
        self, make_paged_store: MakePagedStore
    ) -> None:
        """Every slot first holds NaN keys and infinite values; sequences then fill only their
        own positions. The tails of their last pages, the pages of nobody, and page-table
        padding pointing at a poisoned page must not reach any result."""
        store = make_paged_store(page_size=4, num_pages=12)
        poison(store)
        seqs = sequences(store, seed=5)
        seqs.place(0, [3, 8], 6)  # tail of page 8 poisoned
        seqs.place(1, [5], 1)
        seqs.place(2, [10, 0, 6], 9)
        poisoned_page = 11
        for pad in (0, poisoned_page):
            seqs.check([0, 1, 2], [1, 1, 1], heads=4, pad_page=pad, extra_width=2)
            seqs.check([0, 1, 2], [2, 1, 9], heads=4, pad_page=pad, extra_width=1)
            seqs.check([2, 0], [4, 6], heads=4, pad_page=pad)

    @pytest.mark.spec("PST-013", "PST-017")
    def test_poisoned_padding_of_a_decode_group_never_leaks(
        self, make_paged_store: MakePagedStore
    ) -> None:
        """Decoding sequences of contexts 10, 9, 8 and 7 (each at least 0.7 of the longest, so
        PST-017 lets one gather, padded to 10, serve them all) over a pool first filled with
        NaN keys and infinite values: positions past each shorter context are poisoned tails of
        its last page or page-table padding pointing at a poisoned page, and must not reach any
        result, alone, beside a continuing chunk, or beside a short context in a group of its
        own."""
        store = make_paged_store(page_size=4, num_pages=16)
        poison(store)
        seqs = sequences(store, seed=13)
        seqs.place(0, [3, 8, 5], 10)  # positions 10, 11 of page 5 poisoned
        seqs.place(1, [12, 1, 14], 9)  # 3 poisoned positions on page 14
        seqs.place(2, [10, 0], 8)  # pads through the page table's padding
        seqs.place(3, [6, 2], 7)  # position 7 of page 2 poisoned, then padding
        seqs.place(4, [9], 2)  # a short context: a group of its own
        poisoned_page = 15
        for pad in (poisoned_page, 3):  # a poisoned page, or another sequence's
            seqs.check([0, 1, 2, 3], [1, 1, 1, 1], heads=4, pad_page=pad)
            seqs.check([3, 2, 1, 0], [1, 1, 1, 1], heads=8, pad_page=pad, extra_width=1)
            seqs.check([2, 0, 4, 3, 1], [1, 1, 1, 5, 1], heads=4, pad_page=pad)

    @pytest.mark.spec("PST-014", "PST-030")
    def test_recycled_pages_hold_only_the_new_owner(self, make_paged_store: MakePagedStore) -> None:
        """A pool exactly full: a sequence's pages are taken back (unclear) and handed to two
        new sequences in another order; the stale K/V left in their tails never count, and
        each gives what it gives on fresh pages of another store."""
        store = make_paged_store(page_size=4, num_pages=3)
        old = sequences(store, seed=1)
        old.place(0, [0, 1, 2], 12)
        recycled = sequences(store, seed=2)
        recycled.place(1, [2, 0], 6)  # page 0 keeps 2 stale positions of sequence 0
        recycled.place(2, [1], 3)  # one stale position
        recycled.check([1, 2], [6, 1], heads=4)
        recycled.check([1, 2], [1, 3], heads=4)
        recycled.check([1, 2], [2, 2], heads=4)
        fresh = sequences(make_paged_store(page_size=4, num_pages=8), seed=9)
        recycled.copy_to(1, fresh, [6, 7])
        recycled.copy_to(2, fresh, [3])
        query = recycled.query(8, heads=4)
        for layer in range(2):
            got = recycled.attend(layer, [1, 2], [5, 3], query)
            other = fresh.attend(layer, [1, 2], [5, 3], query)
            torch.testing.assert_close(got, other, atol=ATOL, rtol=0)

    @pytest.mark.spec("PST-014")
    def test_same_sequence_on_permuted_pages_attends_the_same(
        self, make_paged_store: MakePagedStore
    ) -> None:
        """The same logical K/V on ascending, descending and shuffled pages."""
        first: torch.Tensor | None = None
        source = sequences(make_paged_store(page_size=3, num_pages=10), seed=4)
        source.place(0, [0, 1, 2, 3], 11)
        query = source.query(4, heads=4)
        for pages in ([0, 1, 2, 3], [9, 7, 4, 1], [5, 3, 8, 0]):
            target = sequences(make_paged_store(page_size=3, num_pages=10), seed=0)
            source.copy_to(0, target, pages)
            out = target.attend(0, [0], [4], query)
            torch.testing.assert_close(
                out.double(), target.expected(0, [0], [4], query), atol=ATOL, rtol=0
            )
            if first is None:
                first = out
            torch.testing.assert_close(out, first, atol=ATOL, rtol=0)

    @pytest.mark.spec("PST-020")
    def test_any_split_of_the_pool_between_sequences_works(
        self, make_paged_store: MakePagedStore
    ) -> None:
        """One sequence holding every page (in reverse order), or every page held by a
        different sequence."""
        whole = sequences(make_paged_store(page_size=4, num_pages=8), seed=6)
        whole.place(0, list(reversed(range(8))), 32)
        whole.check([0], [32], heads=4)
        whole.check([0], [1], heads=4)
        whole.check([0], [13], heads=4)
        split = sequences(make_paged_store(page_size=4, num_pages=8), seed=7)
        for seq in range(8):
            split.place(seq, [7 - seq], 1 + seq % 4)
        split.check(list(range(8)), [1] * 8, heads=4)
        split.check(list(range(8)), [1 + seq % 4 for seq in range(8)], heads=4)

    @pytest.mark.spec("PST-018")
    @pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
    def test_16_bit_decode_attention_is_float32_rounded_once(
        self, make_paged_store: MakePagedStore, dtype: str
    ) -> None:
        """A 16-bit CPU pool, eight decoding sequences of up to 150 positions, K/V and queries
        of magnitude about 3: each output element is the float64 dense result rounded to the
        dtype, or one step of it away (attention computed in the 16-bit dtype lands further)."""
        half = getattr(torch, dtype)
        store = make_paged_store(num_layers=1, head_dim=64, num_pages=256, dtype=dtype)
        gen = torch.Generator().manual_seed(3)
        contexts = [150, 140, 149, 131, 147, 9, 121, 150]
        tables, keys, values, first = [], [], [], 0
        for context in contexts:
            pages = list(range(first, first + -(-context // 4)))
            first += len(pages)
            key = (torch.randn(context, 2, 64, generator=gen) * 3).to(half)
            value = (torch.randn(context, 2, 64, generator=gen) * 3).to(half)
            store.write(0, slots_of(pages, 4, context), key, value)
            tables.append(pages)
            keys.append(key)
            values.append(value)
        query = (torch.randn(len(contexts), 4, 64, generator=gen) * 3).to(half)
        got = attend(store, 0, query, make_batch(tables, [1] * len(contexts), contexts), SCALE)
        assert got.dtype == half
        want = torch.cat(
            [
                dense_reference(query[b : b + 1], keys[b], values[b], SCALE)
                for b in range(len(contexts))
            ]
        )
        rounded = want.to(half).double()
        step = (rounded.abs() * torch.finfo(half).eps).clamp_min(torch.finfo(half).tiny)
        worst = float(((got.double() - rounded).abs() / step).max())
        assert worst <= 1.0, f"an element {worst:.1f} steps of {dtype} from the rounded result"

    @pytest.mark.spec("PST-016")
    def test_write_and_attention_never_read_a_tensor_on_the_host(
        self, make_paged_store: MakePagedStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``prepare`` reads the batch; every layer's ``write`` and ``attention`` then run
        with every way of reading a tensor's value on the host disabled, and still give the
        dense result."""
        store = make_paged_store(num_layers=3, num_pages=16)
        seqs = sequences(store, seed=16)
        for seq, (pages, length) in enumerate(
            [([3, 8, 5], 9), ([1, 12], 5), ([10, 0, 6], 11), ([14], 2)]
        ):
            seqs.place(seq, pages, length)
        batch = make_batch([seqs.pages[s] for s in range(4)], [1, 5, 3, 1], [9, 5, 11, 2])
        slots = torch.tensor([60, 61, 62, 63])  # page 15: no sequence's
        metadata = store.prepare(batch)
        query = seqs.query(10, heads=4)
        kv = torch.randn(4, 2, 8)
        outputs = []
        with monkeypatch.context() as patch:

            def refuse(*args: object, **kwargs: object) -> None:
                raise AssertionError("a tensor value was read on the host")

            for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
                patch.setattr(torch.Tensor, name, refuse)
            for name in ("aminmax", "nonzero", "unique"):
                patch.setattr(torch, name, refuse)
            for layer in range(3):
                store.write(layer, slots, kv, kv)
                outputs.append(store.attention(layer, query, metadata, SCALE))
        for layer, out in enumerate(outputs):
            want = seqs.expected(layer, [0, 1, 2, 3], [1, 5, 3, 1], query)
            torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=0)

    @pytest.mark.spec("PST-016")
    def test_metadata_of_several_batches_is_used_in_any_order(
        self, make_paged_store: MakePagedStore
    ) -> None:
        """Two batches of four query rows each, prepared one after the other, then attended
        layer by layer in another order, the first prepared last: each gives its own dense
        result (no per-batch state kept in the store)."""
        store = make_paged_store(num_layers=3, num_pages=16)
        seqs = sequences(store, seed=17)
        for seq, (pages, length) in enumerate(
            [([3, 8], 7), ([1], 4), ([10], 2), ([0, 6], 6), ([2, 9, 11], 9)]
        ):
            seqs.place(seq, pages, length)
        first = make_batch([seqs.pages[s] for s in (0, 1)], [3, 1], [7, 4])
        second = make_batch([seqs.pages[s] for s in (2, 3, 4)], [2, 1, 1], [2, 6, 9])
        m1, m2 = store.prepare(first), store.prepare(second)
        q1, q2 = seqs.query(4, heads=4), seqs.query(4, heads=4)
        for layer in (2, 0, 1):
            out2 = store.attention(layer, q2, m2, SCALE)
            out1 = store.attention(layer, q1, m1, SCALE)
            want1 = seqs.expected(layer, [0, 1], [3, 1], q1)
            want2 = seqs.expected(layer, [2, 3, 4], [2, 1, 1], q2)
            torch.testing.assert_close(out1.double(), want1, atol=ATOL, rtol=0)
            torch.testing.assert_close(out2.double(), want2, atol=ATOL, rtol=0)

    # -- CUDA --------------------------------------------------------------------------------

    @pytest.mark.requires("cuda")
    @pytest.mark.spec("PST-010", "PST-013")
    def test_cuda_store_matches_the_dense_reference(self, make_paged_store: MakePagedStore) -> None:
        """The same checks on a CUDA store: shuffled pages, poisoned slots, continuing chunks."""
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available on this machine")
        store = make_paged_store(page_size=4, num_pages=16, device="cuda")
        poison(store)
        seqs = sequences(store, seed=8)
        seqs.place(0, [9, 2, 14], 10)
        seqs.place(1, [5, 11], 7)
        seqs.place(2, [0], 2)
        seqs.check([0, 1, 2], [4, 1, 2], heads=4, pad_page=15, extra_width=1)
        seqs.check([0, 1, 2], [1, 1, 1], heads=4, pad_page=15)
