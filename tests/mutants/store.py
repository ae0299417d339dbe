"""Deliberately broken PagedStores: the reference store behind a wrapper with one bug each.

Each wrapper satisfies the PagedStore Protocol and delegates to the reference store; the bugs in
attention are written over the Protocol's ``read`` (gathering K/V slot by slot), so they do not
depend on the reference's internals. A wrapper's ``prepare`` returns its own metadata: the
batch it was prepared from beside the reference's metadata (the reference checks the batch
there, as the Protocol asks). Every one gives right answers on the cases the first suite had:
fresh pools, ascending page tables, whole-context prefills and decode rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch

from pagedkv.interfaces import AttentionBatch, AttentionMetadata, PagedStore, StoreConfig


@dataclass(frozen=True, slots=True)
class WrappedMetadata:
    """A wrapper's metadata: the batch as the wrapper will read it, and what the reference
    store prepared from it."""

    batch: AttentionBatch
    inner: AttentionMetadata


class _Wrapper:
    """Delegates everything to the reference store."""

    def __init__(self, inner: PagedStore) -> None:
        self.inner = inner

    @property
    def config(self) -> StoreConfig:
        return self.inner.config

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        self.inner.write(layer, slots, key, value)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read(layer, slots)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.inner.copy_pages(src, dst)

    def batch_read(self, batch: AttentionBatch) -> AttentionBatch:
        """The batch as this store reads it (the reference's own, unless the bug is there)."""
        return batch

    def prepare(self, batch: AttentionBatch) -> AttentionMetadata:
        read = self.batch_read(batch)
        return WrappedMetadata(read, self.inner.prepare(read))

    def attention(
        self, layer: int, query: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert isinstance(metadata, WrappedMetadata), "metadata of another store"
        return self.inner.attention(layer, query, metadata.inner, scale)


class _OwnAttention(_Wrapper):
    """Attention over ``read``: per sequence, gather the positions :meth:`visible` names and
    apply its mask. Validation is the reference's (``prepare`` and the layer's checks run
    first, their result discarded)."""

    def visible(self, q_len: int, ctx: int, width: int) -> tuple[int, torch.Tensor]:
        """``(n, mask)``: gather positions ``0..n-1``; ``mask[j, p]`` lets row ``j`` see ``p``."""
        rows = torch.arange(ctx - q_len, ctx)[:, None]
        return ctx, torch.arange(ctx)[None, :] <= rows

    def attention(
        self, layer: int, query: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        super().attention(layer, query, metadata, scale)  # raises on a bad layer or query
        assert isinstance(metadata, WrappedMetadata)
        batch = metadata.batch
        assert batch.page_tables is not None
        page_size = self.config.page_size
        out = torch.empty_like(query)
        starts = batch.query_start.tolist()
        for b, (start, stop) in enumerate(itertools.pairwise(starts)):
            ctx = int(batch.context_lens[b])
            table = batch.page_tables[b]
            n, mask = self.visible(stop - start, ctx, table.shape[0] * page_size)
            positions = torch.arange(n, device=table.device)
            slots = table[positions // page_size] * page_size + positions % page_size
            k, v = self.read(layer, slots)
            groups = query.shape[1] // k.shape[1]
            k = k.to(query.dtype).repeat_interleave(groups, dim=1).transpose(0, 1)
            v = v.to(query.dtype).repeat_interleave(groups, dim=1).transpose(0, 1)
            q = query[start:stop].transpose(0, 1)
            scores = q @ k.transpose(1, 2) * scale + self.bias(mask.to(query.device))
            out[start:stop] = (scores.softmax(-1) @ v).transpose(0, 1)
        return out

    def bias(self, mask: torch.Tensor) -> torch.Tensor:
        """Additive mask: 0 where seen, -inf elsewhere (fine: every gathered slot is finite)."""
        return torch.zeros(mask.shape).masked_fill(~mask, -math.inf)


class AscendingPages(_Wrapper):
    """(store-a) reads each sequence's pages in ascending page order, not page-table order:
    right whenever a pool hands out pages in order (class 2, PST-014)."""

    def batch_read(self, batch: AttentionBatch) -> AttentionBatch:
        if batch.page_tables is None:
            return batch  # the reference refuses it
        contexts = batch.on_host.context_lens.tolist()
        # The host copy too (PST-051): the store reads its pages from there.
        host = batch.host
        if host is not None and host.page_tables is not None:
            host = dataclasses.replace(host, page_tables=self._sorted(host.page_tables, contexts))
        return dataclasses.replace(
            batch, page_tables=self._sorted(batch.page_tables, contexts), host=host
        )

    def _sorted(self, page_tables: torch.Tensor, contexts: list[int]) -> torch.Tensor:
        """``page_tables`` with each sequence's used pages in ascending order."""
        tables = page_tables.clone()
        page_size = self.config.page_size
        for b, ctx in enumerate(contexts):
            used = -(-ctx // page_size)
            tables[b, :used] = torch.sort(tables[b, :used]).values
        return tables


class MaskOnlyBySoftmax(_OwnAttention):
    """(store-b) gathers whole pages of the page table (padding included) and hides what lies
    outside the context only by a -inf score: a NaN key or an infinite value there poisons the
    result (class 3, PST-013)."""

    def visible(self, q_len: int, ctx: int, width: int) -> tuple[int, torch.Tensor]:
        rows = torch.arange(ctx - q_len, ctx)[:, None]
        return width, torch.arange(width)[None, :] <= rows


class TopLeftCausalMask(_OwnAttention):
    """(store-c) a chunk's causal mask is aligned to the top left, as ``is_causal`` does for
    a short query over a longer context: row ``j`` of a chunk continuing a cached context sees
    positions ``0..j`` only (class 1, PST-011)."""

    def visible(self, q_len: int, ctx: int, width: int) -> tuple[int, torch.Tensor]:
        if q_len == 1:
            return super().visible(q_len, ctx, width)
        return ctx, torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None]


class ChunkIgnoresCachedContext(_OwnAttention):
    """(store-d) a multi-row chunk attends only over its own rows, as if the cached context
    did not exist (class 1, PST-012)."""

    def visible(self, q_len: int, ctx: int, width: int) -> tuple[int, torch.Tensor]:
        n, mask = super().visible(q_len, ctx, width)
        if q_len > 1:
            mask = mask & (torch.arange(ctx)[None, :] >= ctx - q_len)
        return n, mask


class DecodeMissesNewest(_OwnAttention):
    """(store-e) a decode row does not see its own, newest position (off by one)."""

    def visible(self, q_len: int, ctx: int, width: int) -> tuple[int, torch.Tensor]:
        n, mask = super().visible(q_len, ctx, width)
        if q_len == 1 and ctx > 1:
            mask = mask & (torch.arange(ctx)[None, :] < ctx - 1)
        return n, mask


class WriteIgnoresLayer(_Wrapper):
    """(store-f) every layer's K/V are written into layer 0's pool (PST-004)."""

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        self.inner.write(0, slots, key, value)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read(0, slots)

    def attention(
        self, layer: int, query: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return super().attention(0, query, metadata, scale)
