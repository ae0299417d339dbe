"""The reference PagedStore: K/V page pools in torch tensors and paged causal attention.

The pools are allocated once, at construction, as ``[num_layers, num_pages, page_size,
num_kv_heads, head_dim]`` tensors for K and for V (PST-001); a flat slot ``s`` is position
``s % page_size`` of page ``s // page_size``. The store never decides which page belongs to
whom: it writes at the slots and reads through the page tables the caller gives (PST-030).

This module imports torch; :mod:`pagedkv.kv` does not import it (KVM-040).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch, StoreConfig

#: The dtype names a :class:`~pagedkv.interfaces.StoreConfig` (and the loader) accepts.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``float32``, ``bfloat16`` or ``float16``).

    Raises:
        InvalidRequest: any other name.
    """
    dtype = DTYPES.get(name)
    if dtype is None:
        raise InvalidRequest(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}")
    return dtype


def torch_device(name: str | torch.device) -> torch.device:
    """The torch device ``name`` (``cpu``, ``cuda``, ``cuda:1``, ...), checked to be usable.

    Raises:
        InvalidRequest: an unparsable name, or a CUDA device on a machine without CUDA.
    """
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequest(f"invalid device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device {name!r} requested but CUDA is not available")
    return device


def bytes_per_page(config: StoreConfig) -> int:
    """Bytes one page costs across every layer, K and V together (``config.num_pages`` unused).

    ``2 * num_layers * page_size * num_kv_heads * head_dim * itemsize``.
    """
    itemsize = torch.empty((), dtype=torch_dtype(config.dtype)).element_size()
    return (
        2 * config.num_layers * config.page_size * config.num_kv_heads * config.head_dim * itemsize
    )


def pages_for_budget(config: StoreConfig, budget_bytes: int) -> int:
    """How many whole pages of ``config``'s shape fit in ``budget_bytes`` (PST-002).

    Raises:
        InvalidRequest: not even one page fits.
    """
    per_page = bytes_per_page(config)
    pages = budget_bytes // per_page
    if pages < 1:
        raise InvalidRequest(f"a budget of {budget_bytes} bytes holds no page of {per_page} bytes")
    return pages


def _validate_config(config: StoreConfig) -> tuple[torch.dtype, torch.device]:
    for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages"):
        value = getattr(config, name)
        if value < 1:
            raise InvalidRequest(f"StoreConfig.{name} must be >= 1, got {value}")
    return torch_dtype(config.dtype), torch_device(config.device)


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One sequence attended on its own: rows ``start:stop`` over the K/V at ``slots``."""

    start: int
    stop: int
    slots: torch.Tensor  # [context_len] int64
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when no masking is needed
    is_causal: bool  # q_len == context_len: plain top-left causal mask


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Sequences with one query row each, attended together over a padded gather."""

    rows: torch.Tensor  # [n] int64 query rows
    slots: torch.Tensor  # [n, max_ctx] int64; positions past the context read position 0's
    valid: torch.Tensor  # [n, max_ctx] bool, position < context_len


@dataclass(frozen=True, slots=True)
class _Layout:
    """Slots and masks of one AttentionBatch, shared by every layer of a step."""

    num_rows: int
    decode: _DecodeGroup | None
    chunks: tuple[_Chunk, ...]


class TorchPagedStore:
    """K/V page pools for every layer, written at flat slots and read by page tables.

    Args:
        config: the pool's shape. Every count must be >= 1 and ``dtype`` one of
            :data:`DTYPES`. The pools are allocated here, zero-filled, and never reallocated.

    Raises:
        InvalidRequest: a count below 1, an unknown dtype or an unusable device.
    """

    def __init__(self, config: StoreConfig) -> None:
        dtype, device = _validate_config(config)
        self._config = config
        self._num_slots = config.num_pages * config.page_size
        shape = (
            2,
            config.num_layers,
            config.num_pages,
            config.page_size,
            config.num_kv_heads,
            config.head_dim,
        )
        self._kv = torch.zeros(shape, dtype=dtype, device=device)
        self._layout_batch: AttentionBatch | None = None
        self._layout: _Layout | None = None

    @classmethod
    def from_budget(cls, config: StoreConfig, budget_bytes: int) -> TorchPagedStore:
        """A store with as many pages as fit in ``budget_bytes`` (``config.num_pages`` ignored)."""
        pages = pages_for_budget(config, budget_bytes)
        return cls(dataclasses.replace(config, num_pages=pages))

    @property
    def config(self) -> StoreConfig:
        """The pool's shape."""
        return self._config

    @property
    def num_slots(self) -> int:
        """``num_pages * page_size``: flat slots per layer."""
        return self._num_slots

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V pools of every layer."""
        return self._kv.numel() * self._kv.element_size()

    def key_pool(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K pool, ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        self._check_layer(layer)
        return self._kv[0, layer]

    def value_pool(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V pool, ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        self._check_layer(layer)
        return self._kv[1, layer]

    # -- write / read ----------------------------------------------------------------------

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store ``key[i]`` and ``value[i]`` (``[num_kv_heads, head_dim]``) at ``slots[i]``.

        Preconditions: ``slots`` is ``[N]`` integer with distinct values in
        ``[0, num_slots)``; ``key`` and ``value`` are ``[N, num_kv_heads, head_dim]``. They are
        cast to the pool dtype and detached from autograd.

        Raises:
            InvalidRequest: a layer, shape or slot out of range.
        """
        self._check_layer(layer)
        index = self._check_slots(slots)
        expected = (index.shape[0], self._config.num_kv_heads, self._config.head_dim)
        for name, tensor in (("key", key), ("value", value)):
            if tuple(tensor.shape) != expected:
                raise InvalidRequest(
                    f"{name} must be shaped {list(expected)}, got {list(tensor.shape)}"
                )
        pool_dtype = self._kv.dtype
        self._flat(0, layer).index_copy_(0, index, key.detach().to(pool_dtype))
        self._flat(1, layer).index_copy_(0, index, value.detach().to(pool_dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V stored at ``slots``, each ``[len(slots), num_kv_heads, head_dim]``.

        Raises:
            InvalidRequest: a layer or slot out of range.
        """
        self._check_layer(layer)
        index = self._check_slots(slots)
        return (
            self._flat(0, layer).index_select(0, index),
            self._flat(1, layer).index_select(0, index),
        )

    # -- attention ---------------------------------------------------------------------------

    def attention(
        self,
        layer: int,
        query: torch.Tensor,
        batch: AttentionBatch,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, num_heads, head_dim]`` over paged K/V.

        Sequence ``b`` owns rows ``query_start[b]:query_start[b+1]``: its last ``q_len``
        positions of ``context_len``, so its row ``j`` sees positions
        ``0..context_len - q_len + j`` (PST-011). Its K/V are gathered through its page table
        only up to ``context_len`` (PST-020); sequences with a single row are batched over a
        padded gather whose padding re-reads the sequence's position 0 and is masked out, so
        stale slot contents never reach the result (PST-013). ``num_heads`` must be a multiple
        of ``num_kv_heads`` (GQA).

        The slots and masks of ``batch`` are computed on the first call for it and reused by
        later calls with the same object (every layer of a step): do not modify its tensors
        in place between calls.

        Returns:
            ``[T, num_heads, head_dim]`` in ``query``'s dtype.

        Raises:
            InvalidRequest: no page tables (a cache-less batch), or shapes, offsets, context
                lengths or pages out of range.
        """
        self._check_layer(layer)
        if query.dim() != 3 or query.shape[2] != self._config.head_dim:
            raise InvalidRequest(
                f"query must be [T, num_heads, {self._config.head_dim}], got {list(query.shape)}"
            )
        if query.shape[1] % self._config.num_kv_heads != 0:
            raise InvalidRequest(
                f"num_heads={query.shape[1]} is not a multiple of "
                f"num_kv_heads={self._config.num_kv_heads}"
            )
        layout = self._layout_of(batch)
        if layout.num_rows != query.shape[0]:
            raise InvalidRequest(
                f"the batch covers {layout.num_rows} query rows, query has {query.shape[0]}"
            )
        keys, values = self._flat(0, layer), self._flat(1, layer)
        out = torch.empty_like(query)
        if layout.decode is not None:
            out.index_copy_(
                0, layout.decode.rows, self._decode(query, keys, values, layout.decode, scale)
            )
        for chunk in layout.chunks:
            out[chunk.start : chunk.stop] = self._chunk(query, keys, values, chunk, scale)
        return out

    def _decode(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        group: _DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        q = query.index_select(0, group.rows)[:, :, None, :]  # [n, H, 1, D]
        # index_select on the flat slots gathers about 2x faster than advanced indexing.
        n, width = group.slots.shape
        flat = group.slots.reshape(-1)
        k = keys.index_select(0, flat).view(n, width, *keys.shape[1:])
        v = values.index_select(0, flat).view(n, width, *values.shape[1:])
        k = k.to(query.dtype).transpose(1, 2)  # [n, KV, max_ctx, D]
        v = v.to(query.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.valid[:, None, None, :], scale=scale, enable_gqa=True
        )
        return out[:, :, 0, :]

    def _chunk(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        chunk: _Chunk,
        scale: float,
    ) -> torch.Tensor:
        # 4-D inputs (a batch of one): unbatched 3-D ones miss the fused CPU kernel.
        q = query[None, chunk.start : chunk.stop].transpose(1, 2)  # [1, H, q_len, D]
        k = keys.index_select(0, chunk.slots).to(query.dtype)[None].transpose(1, 2)
        v = values.index_select(0, chunk.slots).to(query.dtype)[None].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=chunk.mask,
            is_causal=chunk.is_causal,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    # -- helpers ----------------------------------------------------------------------------

    def _flat(self, kv: int, layer: int) -> torch.Tensor:
        c = self._config
        return self._kv[kv, layer].view(self._num_slots, c.num_kv_heads, c.head_dim)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self._config.num_layers:
            raise InvalidRequest(f"layer {layer} outside 0..{self._config.num_layers - 1}")

    def _check_slots(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.dim() != 1 or slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise InvalidRequest(
                f"slots must be a 1-D integer tensor, got {slots.dtype} {list(slots.shape)}"
            )
        index = slots.to(device=self._kv.device, dtype=torch.int64)
        if index.numel():
            low, high = (int(x) for x in torch.aminmax(index))
            if low < 0 or high >= self._num_slots:
                raise InvalidRequest(f"slots span {low}..{high}, outside 0..{self._num_slots - 1}")
        return index

    def _layout_of(self, batch: AttentionBatch) -> _Layout:
        """The batch's layout, computed once per batch object and reused by every layer."""
        if batch is not self._layout_batch or self._layout is None:
            self._layout = self._build_layout(batch)
            self._layout_batch = batch
        return self._layout

    def _build_layout(self, batch: AttentionBatch) -> _Layout:
        if batch.page_tables is None:
            raise InvalidRequest("paged attention needs page tables; the batch has none (v0)")
        device = self._kv.device
        page_size = self._config.page_size
        starts = [int(x) for x in batch.query_start.tolist()]
        contexts = [int(x) for x in batch.context_lens.tolist()]
        tables = batch.page_tables.to(device=device, dtype=torch.int64)
        num_seqs = len(contexts)
        if len(starts) != num_seqs + 1 or starts[0] != 0:
            raise InvalidRequest(
                f"query_start must be [B+1] offsets from 0; got {starts} for B={num_seqs}"
            )
        if tables.dim() != 2 or tables.shape[0] != num_seqs:
            raise InvalidRequest(f"page_tables must be [{num_seqs}, max_pages]")
        if tables.numel():
            low, high = (int(x) for x in torch.aminmax(tables))
            if low < 0 or high >= self._config.num_pages:
                raise InvalidRequest(
                    f"page tables name pages {low}..{high}, outside 0..{self._config.num_pages - 1}"
                )
        capacity = tables.shape[1] * page_size
        for b in range(num_seqs):
            q_len = starts[b + 1] - starts[b]
            if not 1 <= q_len <= contexts[b] <= capacity:
                raise InvalidRequest(
                    f"sequence {b}: need 1 <= q_len ({q_len}) <= context_len ({contexts[b]}) "
                    f"<= page table capacity ({capacity})"
                )
        decode_ids = [b for b in range(num_seqs) if starts[b + 1] - starts[b] == 1]
        decode: _DecodeGroup | None = None
        if decode_ids:
            max_ctx = max(contexts[b] for b in decode_ids)
            positions = torch.arange(max_ctx, device=device)
            ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
            ctx = torch.tensor([contexts[b] for b in decode_ids], dtype=torch.int64, device=device)
            pages = tables.index_select(0, ids)[:, positions // page_size]
            slots = pages * page_size + positions % page_size
            valid = positions[None, :] < ctx[:, None]
            decode = _DecodeGroup(
                rows=torch.tensor(
                    [starts[b] for b in decode_ids], dtype=torch.int64, device=device
                ),
                # Padding re-reads the sequence's own position 0 (always written, so finite)
                # rather than stale slots, which may hold anything; the mask zeroes its weight.
                slots=torch.where(valid, slots, slots[:, :1]),
                valid=valid,
            )
        chunks: list[_Chunk] = []
        for b in range(num_seqs):
            q_len, ctx_len = starts[b + 1] - starts[b], contexts[b]
            if q_len == 1:
                continue
            positions = torch.arange(ctx_len, device=device)
            mask: torch.Tensor | None = None
            if q_len < ctx_len:
                last_seen = torch.arange(ctx_len - q_len, ctx_len, device=device)
                mask = positions[None, :] <= last_seen[:, None]
            chunks.append(
                _Chunk(
                    start=starts[b],
                    stop=starts[b + 1],
                    slots=tables[b, positions // page_size] * page_size + positions % page_size,
                    mask=mask,
                    is_causal=q_len == ctx_len,
                )
            )
        return _Layout(num_rows=starts[-1], decode=decode, chunks=tuple(chunks))
