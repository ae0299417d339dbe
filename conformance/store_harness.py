"""Helpers of the PagedStore conformance tests: the one call into attention, a dense float64
reference, and sequences laid out on pages the test chooses (shuffled, recycled, poisoned)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.interfaces import AttentionBatch, PagedStore, StoreConfig

#: Max abs difference allowed between float32 paged attention and the float64 reference.
ATOL = 1e-5
#: The softmax scale the suite passes: not ``head_dim ** -0.5``, so a store that drops the
#: scale it is given (and falls back to that default) fails.
SCALE = 0.3


def attend(
    store: PagedStore, layer: int, query: torch.Tensor, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    """The one place the suite runs a store's attention, so a change of the PagedStore
    Protocol's attention calls is a change here only: the step's metadata from
    ``prepare(batch)`` (which checks the batch), then the layer's attention over it."""
    return store.attention(layer, query, store.prepare(batch), scale)


def dense_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of ``query`` ``[q, H, D]`` as the last ``q`` of ``key``'s positions.

    ``key`` and ``value`` are ``[n, KV, D]``. Float64, explicit mask, explicit GQA head
    repetition: independent of any store's code path.
    """
    q_len, heads, _ = query.shape
    ctx = key.shape[0]
    groups = heads // key.shape[1]
    q = query.double().transpose(0, 1)
    k = key.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    v = value.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale  # [H, q, n]
    rows = torch.arange(q_len)[:, None] + (ctx - q_len)
    allowed = torch.arange(ctx)[None, :] <= rows
    scores = scores.masked_fill(~allowed, -math.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1)


def slots_of(pages: Sequence[int], page_size: int, length: int) -> torch.Tensor:
    """Flat slots of positions ``0..length-1`` of a sequence on ``pages`` (KVM-005)."""
    return torch.tensor(
        [pages[p // page_size] * page_size + p % page_size for p in range(length)],
        dtype=torch.int64,
    )


def make_batch(
    page_tables: Sequence[Sequence[int]],
    q_lens: Sequence[int],
    context_lens: Sequence[int],
    pad_page: int = 0,
    extra_width: int = 0,
) -> AttentionBatch:
    """A ragged batch; page tables are padded with ``pad_page`` to the widest plus
    ``extra_width`` columns."""
    width = max(len(p) for p in page_tables) + extra_width
    padded = [list(p) + [pad_page] * (width - len(p)) for p in page_tables]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionBatch(
        query_start=torch.tensor(starts, dtype=torch.int64),
        context_lens=torch.tensor(list(context_lens), dtype=torch.int64),
        page_tables=torch.tensor(padded, dtype=torch.int64),
    )


@dataclass
class Sequences:
    """Logical K/V of sequences written into a store on pages the test picks.

    Attributes:
        store: the store under test.
        generator: seeded source of K/V and queries.
        pages: each sequence's page table.
        keys, values: each sequence's logical K/V per layer, ``[n, KV, D]``.
    """

    store: PagedStore
    generator: torch.Generator
    pages: dict[int, list[int]] = field(default_factory=dict)
    keys: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    values: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def config(self) -> StoreConfig:
        return self.store.config

    def length(self, seq: int) -> int:
        return int(self.keys[seq][0].shape[0])

    def place(self, seq: int, pages: Sequence[int], length: int) -> None:
        """Write ``length`` fresh random positions of ``seq`` on ``pages`` (in that order)."""
        cfg = self.config
        if len(pages) * cfg.page_size < length:
            raise ValueError(f"{len(pages)} pages cannot hold {length} positions")
        slots = slots_of(pages, cfg.page_size, length)
        shape = (length, cfg.num_kv_heads, cfg.head_dim)
        self.pages[seq] = list(pages)
        self.keys[seq], self.values[seq] = [], []
        for layer in range(cfg.num_layers):
            k = torch.randn(shape, generator=self.generator)
            v = torch.randn(shape, generator=self.generator)
            self.store.write(layer, slots.to(cfg.device), k.to(cfg.device), v.to(cfg.device))
            self.keys[seq].append(k)
            self.values[seq].append(v)

    def copy_to(self, seq: int, other: Sequences, pages: Sequence[int]) -> None:
        """Write ``seq``'s very K/V into ``other``'s store on ``pages``."""
        cfg = self.config
        slots = slots_of(pages, cfg.page_size, self.length(seq)).to(cfg.device)
        other.pages[seq] = list(pages)
        other.keys[seq], other.values[seq] = self.keys[seq], self.values[seq]
        for layer in range(cfg.num_layers):
            k, v = self.keys[seq][layer], self.values[seq][layer]
            other.store.write(layer, slots, k.to(cfg.device), v.to(cfg.device))

    def query(self, rows: int, heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, self.config.head_dim, generator=self.generator)

    def attend(
        self,
        layer: int,
        seqs: Sequence[int],
        q_lens: Sequence[int],
        query: torch.Tensor,
        pad_page: int = 0,
        extra_width: int = 0,
    ) -> torch.Tensor:
        """The store's attention for the last ``q_lens`` positions of ``seqs`` (on the CPU)."""
        batch = make_batch(
            [self.pages[s] for s in seqs],
            q_lens,
            [self.length(s) for s in seqs],
            pad_page,
            extra_width,
        )
        device = self.config.device
        moved = AttentionBatch(
            batch.query_start.to(device),
            batch.context_lens.to(device),
            None if batch.page_tables is None else batch.page_tables.to(device),
        )
        return attend(self.store, layer, query.to(device), moved, SCALE).cpu()

    def expected(
        self, layer: int, seqs: Sequence[int], q_lens: Sequence[int], query: torch.Tensor
    ) -> torch.Tensor:
        """The dense reference for the same rows, ``[T, H, D]`` float64."""
        parts, row = [], 0
        for seq, q_len in zip(seqs, q_lens, strict=True):
            parts.append(
                dense_reference(
                    query[row : row + q_len], self.keys[seq][layer], self.values[seq][layer], SCALE
                )
            )
            row += q_len
        return torch.cat(parts)

    def check(
        self,
        seqs: Sequence[int],
        q_lens: Sequence[int],
        heads: int,
        pad_page: int = 0,
        extra_width: int = 0,
    ) -> None:
        """Every layer's attention for the batch equals the dense reference (PST-010)."""
        query = self.query(sum(q_lens), heads)
        for layer in range(self.config.num_layers):
            got = self.attend(layer, seqs, q_lens, query, pad_page, extra_width)
            assert got.shape == query.shape
            want = self.expected(layer, seqs, q_lens, query)
            assert torch.isfinite(got).all(), "non-finite attention output"
            torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
