"""The Triton kernels of ``pagedkv.accel.cuda`` against the float64 dense reference, on small
shapes, on the CPU under Triton's interpreter (PST-047; ``tests/conftest.py`` asks for it):
non-contiguous page tables, GQA, head and page sizes that are no power of two, contexts split
several ways, continuing chunks and padded rows."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pagedkv.accel.cuda.decode_kernel import paged_decode
from pagedkv.accel.cuda.kernel_shapes import DECODE_BLOCK_N, block_of, decode_splits
from pagedkv.accel.cuda.prefill_kernel import paged_prefill
from pagedkv.accel.cuda.store_kernel import runs_interpreted, store_kv
from pagedkv.accel.cuda.triton_store import TritonPagedStore
from pagedkv.interfaces import StoreConfig
from pagedkv.plan import AttentionBatch
from pagedkv.store.paged_store import TorchPagedStore

#: PST-010's tolerance on float32 outputs.
ATOL = 1e-5


def dense(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of ``query`` ``[q, H, D]`` as the last ``q`` of ``key``'s ``[n, KV, D]``
    positions, in float64 with explicit head repetition."""
    q_len, heads, _ = query.shape
    context = key.shape[0]
    group = heads // key.shape[1]
    q = query.double().transpose(0, 1)
    k = key.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    seen = torch.arange(q_len)[:, None] + (context - q_len)
    scores = scores.masked_fill(torch.arange(context)[None, :] > seen, -math.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1)


class Pool:
    """Flat K/V pools poisoned with NaN keys and infinite values, sequences placed on shuffled
    pages; page tables padded with a poisoned page."""

    def __init__(
        self, kv_heads: int, head_dim: int, page_size: int, num_pages: int, seed: int
    ) -> None:
        self.page_size = page_size
        self.gen = torch.Generator().manual_seed(seed)
        slots = num_pages * page_size
        self.keys = torch.full((slots, kv_heads, head_dim), math.nan)
        self.values = torch.full((slots, kv_heads, head_dim), math.inf)
        self.free = torch.randperm(num_pages - 1, generator=self.gen).tolist()
        self.poisoned_page = num_pages - 1
        self.tables: list[list[int]] = []
        self.contexts: list[int] = []

    def place(self, context: int) -> None:
        """A sequence of ``context`` positions of random K/V on pages taken in shuffled order."""
        pages = [self.free.pop() for _ in range(-(-context // self.page_size))]
        for position in range(context):
            slot = pages[position // self.page_size] * self.page_size + position % self.page_size
            self.keys[slot] = torch.randn(self.keys.shape[1:], generator=self.gen)
            self.values[slot] = torch.randn(self.values.shape[1:], generator=self.gen)
        self.tables.append(pages)
        self.contexts.append(context)

    def table_tensor(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables) + 1  # every table padded at least once
        rows = [t + [self.poisoned_page] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int32)

    def logical(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq``'s K and V in position order."""
        positions = torch.arange(self.contexts[seq])
        pages = torch.tensor(self.tables[seq])[positions // self.page_size]
        slots = pages * self.page_size + positions % self.page_size
        return self.keys[slots], self.values[slots]


@pytest.mark.spec("PST-047")
def test_the_tests_run_the_kernels_under_the_interpreter() -> None:
    """Without CUDA the conftest must have turned the interpreter on before the kernels were
    defined; else every kernel test here would be refused instead of run (PST-047)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the kernels on its GPU")
    assert runs_interpreted()


@pytest.mark.spec("PST-042")
def test_store_kernel_writes_each_row_at_its_slot_and_skips_padded_rows() -> None:
    """Five rows, two of them padded (slot -1), from a strided view (head stride 8, row stride
    24): the pools hold bit for bit what the reference store's ``write`` of the three real rows
    leaves, float32 rows into a bfloat16 pool rounded to nearest. Kills a slot index off by
    one, a padded row written (slot -1 wraps to the pool's end or before it), a head stride
    taken as the dimension's, a truncating cast."""
    config = StoreConfig(
        num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, num_pages=5, dtype="bfloat16"
    )
    reference = TorchPagedStore(config)
    triton_pools = TorchPagedStore(config)
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 3, 8, generator=gen)
    key, value = wide[:, :2], wide[:, 1:] * 3  # views, not contiguous
    slots = torch.tensor([7, -1, 3, 19, -1])
    keep = torch.tensor([0, 2, 3])
    reference.write(0, slots[keep], key[keep], value[keep])
    keys = triton_pools.key_pool(0).flatten(0, 1)
    values = triton_pools.value_pool(0).flatten(0, 1)
    store_kv(key, value, keys, values, slots)
    assert torch.equal(keys, reference.key_pool(0).flatten(0, 1))
    assert torch.equal(values, reference.value_pool(0).flatten(0, 1))
    assert torch.equal(keys[7], key[0].to(torch.bfloat16))
    assert int((keys != 0).any(-1).any(-1).sum()) == 3  # no other slot changed


@pytest.mark.spec("PST-042", "PST-045")
def test_store_write_skips_padded_rows_and_refuses_slots_past_the_pool() -> None:
    """Through the store: a padded row's slot -1 is skipped, the real rows read back exactly;
    a slot past the pool raises on the CPU. Kills a store that drops the padding rule or lets
    the interpreter write past the pool."""
    from pagedkv.errors import InvalidRequest

    config = StoreConfig(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, num_pages=3)
    store = TritonPagedStore(TorchPagedStore(config))
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 1, 4)
    store.write(1, torch.tensor([5, -1, 0]), rows, -rows)
    got_k, got_v = store.read(1, torch.tensor([5, 0]))
    assert torch.equal(got_k, rows[[0, 2]])
    assert torch.equal(got_v, -rows[[0, 2]])
    assert torch.equal(store.read(0, torch.arange(6))[0], torch.zeros(6, 1, 4))
    with pytest.raises(InvalidRequest):
        store.write(0, torch.tensor([6]), rows[:1], rows[:1])


def test_decode_splits_are_powers_of_two_of_whole_tiles() -> None:
    """The split count the tests below rely on: one split up to a tile, doubling with the
    longest context up to 8; ``block_of`` rounds up to a power of two of at least 16."""
    assert [decode_splits(n) for n in (1, 32, 33, 64, 65, 100, 128, 129, 10_000)] == [
        1,
        1,
        2,
        2,
        4,
        4,
        4,
        8,
        8,
    ]
    assert DECODE_BLOCK_N == 32
    assert [block_of(n) for n in (1, 16, 17, 24, 64)] == [16, 16, 32, 32, 64]
    assert block_of(3, 1) == 4


def decode_case(magnitude: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Five decoding sequences of 100, 37, 1 and 64 positions and a padded row of context 0,
    GQA (8 query heads on 2 KV heads), 24 channels, pages of 5 on shuffled pages, the query
    rows in another order than the sequences: the kernel's output, the dense one, and the
    output row of the padded sequence."""
    pool = Pool(kv_heads=2, head_dim=24, page_size=5, num_pages=48, seed=int(magnitude))
    for context in (100, 37, 1, 64):
        pool.place(context)
    tables = torch.cat([pool.table_tensor(), torch.zeros(1, pool.table_tensor().shape[1])])
    contexts = torch.tensor(pool.contexts + [0], dtype=torch.int32)
    query = torch.randn(5, 8, 24, generator=pool.gen) * magnitude
    rows = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)  # sequence i's row is rows[i]
    seqs = torch.arange(5, dtype=torch.int32)
    scale = 24**-0.5
    out = torch.full_like(query, math.nan)
    paged_decode(
        query,
        pool.keys,
        pool.values,
        tables.to(torch.int32),
        contexts,
        rows,
        seqs,
        out,
        scale,
        pool.page_size,
        decode_splits(100),
    )
    want = torch.zeros(5, 8, 24, dtype=torch.float64)
    for seq in range(4):
        key, value = pool.logical(seq)
        row = int(rows[seq])
        want[row] = dense(query[row : row + 1], key, value, scale)[0]
    return out, want, out[int(rows[4])]


@pytest.mark.spec("PST-043")
@pytest.mark.parametrize("magnitude", [1.0, 40.0], ids=["unit", "scores-past-exp-range"])
def test_split_k_decode_matches_the_dense_reference(magnitude: float) -> None:
    """Four splits of the longest context (100 positions), one of the shortest; keys and
    values outside every context are NaN and infinite; queries of magnitude 40 give scores
    near 150, whose ``exp`` overflows float32. Each row equals its dense attention within
    PST-010's tolerance and the padded row (context 0) is zeros. Kills a split-K merge
    without the max rescale (inf/NaN at magnitude 40), a merge that averages the splits
    unweighted, a split that reads past its end or past the context (NaN), a KV head taken
    as ``head % kv_heads`` instead of ``head // group``, rows and sequences swapped, a page
    index off by one."""
    out, want, padded = decode_case(magnitude)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=ATOL * max(1.0, magnitude), rtol=0)
    assert torch.equal(padded, torch.zeros_like(padded))


def prefill_case(
    q_lens: Sequence[int], contexts: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sequences with ``q_lens[b]`` new rows of ``contexts[b]`` positions (a decode row among
    them, not given to the kernel), GQA 8 on 2, 24 channels, pages of 3: the varlen kernel's
    output (untouched rows NaN), the dense one, and the decode row."""
    pool = Pool(kv_heads=2, head_dim=24, page_size=3, num_pages=64, seed=len(q_lens))
    for context in contexts:
        pool.place(context)
    pool.keys, pool.values = pool.keys.to(dtype), pool.values.to(dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], 8, 24, generator=pool.gen).to(dtype)
    chunks = [b for b, q_len in enumerate(q_lens) if q_len > 1]
    out = torch.full((starts[-1], 8, 24), math.nan)
    scale = 24**-0.5
    paged_prefill(
        query,
        pool.keys,
        pool.values,
        pool.table_tensor(),
        torch.tensor(contexts, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(chunks, dtype=torch.int32),
        max(q_lens[b] for b in chunks),
        out,
        scale,
        pool.page_size,
        upcast=dtype == torch.bfloat16,
    )
    want = torch.full((starts[-1], 8, 24), math.nan, dtype=torch.float64)
    for b in chunks:
        key, value = pool.logical(b)
        want[starts[b] : starts[b + 1]] = dense(query[starts[b] : starts[b + 1]], key, value, scale)
    decode_row = starts[q_lens.index(1)]
    return out, want, decode_row


@pytest.mark.spec("PST-044")
def test_varlen_prefill_matches_the_dense_reference() -> None:
    """One launch for a first chunk of 40 rows (five query tiles of 8 rows x 4 heads), a
    continuing chunk of 7 rows over 30 positions (23 of them written by earlier chunks), a
    chunk of 2 rows, and a decode row between them that the kernel must leave alone; NaN and
    infinite K/V outside every context. Kills a causal mask off by one, a continuing chunk
    that takes its rows for the first positions (bottom-right vs top-left causal), a query
    tile that stops before its last row's position, a row offset taken from the batch
    instead of the sequence, a GQA head mapping or page index off by one."""
    q_lens = [40, 1, 7, 2]
    out, want, decode_row = prefill_case(q_lens, [40, 12, 30, 2], torch.float32)
    assert out[decode_row].isnan().all()
    rows = [r for r in range(sum(q_lens)) if r != decode_row]
    torch.testing.assert_close(out[rows].double(), want[rows], atol=ATOL, rtol=0)


@pytest.mark.spec("PST-044", "PST-047")
def test_varlen_prefill_in_bfloat16() -> None:
    """A bfloat16 pool: within a few bfloat16 steps of the float64 result (the weights are
    rounded to bfloat16 before the value product, as flash attention does). Kills a kernel
    that multiplies bfloat16 tiles as integers under the interpreter (errors of 1e10) or
    reads another dtype's strides."""
    q_lens = [20, 1, 9]
    out, want, decode_row = prefill_case(q_lens, [20, 5, 33], torch.bfloat16)
    rows = [r for r in range(sum(q_lens)) if r != decode_row]
    torch.testing.assert_close(out[rows].double(), want[rows], atol=3e-2, rtol=0)


@pytest.mark.spec("PST-043", "PST-044", "PST-045")
def test_store_attention_of_a_mixed_step_reads_pages_written_by_the_store_kernel() -> None:
    """Through ``TritonPagedStore``: a step of a continuing chunk and two decoding sequences
    writes its rows with the store kernel, then attends in one decode and one varlen launch;
    each row equals the reference store's result on the same pools. Kills an attention that
    runs before the step's own rows are in the pages, or a decode launch given the chunk's
    sequences."""
    config = StoreConfig(num_layers=1, num_kv_heads=2, head_dim=16, page_size=4, num_pages=16)
    reference = TorchPagedStore(config)
    store = TritonPagedStore(reference)
    gen = torch.Generator().manual_seed(5)
    tables = torch.tensor([[9, 2, 14, 0], [3, 11, 0, 0], [7, 1, 12, 5]])
    contexts = [11, 6, 14]
    earlier = [8, 5, 13]  # positions already written
    for seq, length in enumerate(earlier):
        positions = torch.arange(length)
        slots = tables[seq][positions // 4] * 4 + positions % 4
        store.write(0, slots, *torch.randn(2, length, 2, 16, generator=gen))
    starts = torch.tensor([0, 3, 4, 5])
    new_slots = []
    for seq in range(3):
        for position in range(earlier[seq], contexts[seq]):
            new_slots.append(int(tables[seq][position // 4]) * 4 + position % 4)
    batch = AttentionBatch(starts, torch.tensor(contexts), tables, torch.tensor(new_slots))
    metadata = store.prepare(batch)
    key, value = torch.randn(2, 5, 2, 16, generator=gen)
    query = torch.randn(5, 4, 16, generator=gen)
    store.write(0, batch.slot_mapping, key, value)  # type: ignore[arg-type]
    got = store.attention(0, query, metadata, 0.25)
    want = reference.attention(0, query, reference.prepare(batch), 0.25)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.spec("PST-047", "ENG-223")
def test_every_kernel_compiles_for_a_cuda_gpu_without_one() -> None:
    """``tests/triton_gpu_compile.py``, in a process whose kernels are defined for a GPU,
    compiles each kernel through Triton's compiler and ptxas for ``sm_90`` with the 0.6B
    model's heads in bfloat16 and float32. Kills what the interpreter lets through and a GPU
    refuses: a ``tl.dot`` tile under 16, operands of two dtypes, a precision that is not a
    compile-time string, a branch the code generator cannot lower."""
    script = Path(__file__).with_name("triton_gpu_compile.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line.split()[0] for line in done.stdout.splitlines()]
    assert sorted(set(compiled)) == [
        "_decode_merge_kernel",
        "_decode_split_kernel",
        "_prefill_kernel",
        "_rms_norm_kernel",
        "_rms_norm_rope_kernel",
        "_store_kv_kernel",
        "_swiglu_kernel",
    ]
    # The attention's seven, and the fused ops' four (ENG-220) in each of three dtypes.
    assert len(compiled) == 7 + 4 * 3
