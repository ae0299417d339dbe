"""The reference PagedStore: K/V page pools in torch tensors and paged causal attention.

The pools are allocated once, at construction: a ``[num_pages * page_size, num_kv_heads,
head_dim]`` tensor for K and one for V in every layer (PST-001), each a tensor of its own, so
that a compiled step writes it in place (PST-007); a flat slot ``s`` is position
``s % page_size`` of page ``s // page_size``. The store never decides which page belongs to
whom: it writes at the slots and reads through the page tables the caller gives (PST-030).

Each step, :meth:`TorchPagedStore.prepare` checks the step's batch once and lays its attention
out (PST-016); :meth:`TorchPagedStore.write` and :meth:`TorchPagedStore.attention` then run per
layer without a device-to-host synchronisation.

This module imports torch; :mod:`pagedkv.kv` does not import it (KVM-040).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedkv.device import torch_device, torch_dtype
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch, AttentionMetadata, StoreConfig
from pagedkv.store import decode_attention
from pagedkv.store.batch_check import check_paged_batch, check_range
from pagedkv.store.decode_attention import DecodeKernel
from pagedkv.store.gather import gather_rows
from pagedkv.store.native_decode import NativeDecode
from pagedkv.store.one_copy import move_once
from pagedkv.store.ragged_attention import (
    DECODE_FILL,
    HALF_DTYPES,
    AttentionLayout,
    plan_attention,
    ragged_attention,
)


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


def _decode_kernel(
    wanted: bool | None, dtype: torch.dtype, device: torch.device
) -> DecodeKernel | None:
    """The kernel decode groups attend through in a store asked ``fused_decode=wanted``
    (PST-008): on the CPU, the C kernel for float32 and bfloat16 pools where it builds, else
    inductor's for 16-bit pools where it finds a C++ compiler; ``None``: gathered.

    Raises:
        InvalidRequest: ``True`` off the CPU, or where neither kernel can be had.
    """
    if wanted is False:
        return None
    if device.type != "cpu":
        if wanted:
            raise InvalidRequest(
                f"fused_decode runs on the CPU; this pool is on {device.type} (leave it unset)"
            )
        return None
    native = NativeDecode.build(dtype)
    if isinstance(native, NativeDecode):
        return native
    if dtype in HALF_DTYPES and decode_attention.can_compile():
        return decode_attention.CompiledDecode()
    if wanted:
        raise InvalidRequest(
            f"fused_decode needs a C compiler ({native.reason}) or, in a 16-bit pool, "
            "inductor's C++ compiler; leave it unset to attend through gathers"
        )
    return None


@dataclass(frozen=True, slots=True)
class PagedAttentionMetadata:
    """What :meth:`TorchPagedStore.prepare` computed for one step: its validated layout, used
    by every layer. Immutable; valid for any store of the same pool geometry.

    Attributes:
        num_slots: slots per layer of the pool it was prepared for.
        layout: the step's attention groups, their gather indices being flat slots.
    """

    num_slots: int
    layout: AttentionLayout


class TorchPagedStore:
    """K/V page pools for every layer, written at flat slots and read by page tables.

    Args:
        config: the pool's shape. Every count must be >= 1 and ``dtype`` one of
            :data:`~pagedkv.device.DTYPE_NAMES`. The pools are allocated here, zero-filled,
            and never reallocated.
        fused_decode: decode attention read where the K/V lie, without a gathered copy
            (PST-008, :mod:`pagedkv.store.native_decode`,
            :mod:`pagedkv.store.decode_attention`); ``None`` (the default): on a CPU pool
            where one of the kernels can be had. ``False``: gathered into SDPA, as prefill
            chunks always are.

    Raises:
        InvalidRequest: a count below 1, an unknown dtype, an unusable device, or
            ``fused_decode=True`` on a pool not on the CPU or without a C++ compiler.
    """

    def __init__(self, config: StoreConfig, *, fused_decode: bool | None = None) -> None:
        dtype, device = _validate_config(config)
        self._decode = _decode_kernel(fused_decode, dtype, device)
        # Padding a decode group's slot index costs reads only where the decode gathers: a
        # kernel reading each context alone takes every decode of a step in one group (PST-017).
        reads_each = self._decode is not None and self._decode.reads_each_context
        self._decode_fill = 0.0 if reads_each else DECODE_FILL
        self._config = config
        self._num_slots = config.num_pages * config.page_size
        shape = (self._num_slots, config.num_kv_heads, config.head_dim)
        # One tensor per layer and kind (PST-007), flat by slot: K of layer l at 2*l, V at 2*l+1.
        self._pools = tuple(
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * config.num_layers)
        )
        self._dtype, self._device = dtype, device

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
    def fused_decode(self) -> bool:
        """Whether decode groups attend in the fused pass (PST-008)."""
        return self._decode is not None

    @property
    def decode_kernel(self) -> DecodeKernel | None:
        """The kernel decode groups attend through (PST-008), ``None`` where they gather."""
        return self._decode

    @property
    def num_slots(self) -> int:
        """``num_pages * page_size``: flat slots per layer."""
        return self._num_slots

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V pools of every layer."""
        return sum(pool.numel() * pool.element_size() for pool in self._pools)

    def key_pool(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K pool, ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        return self._paged(0, layer)

    def value_pool(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V pool, ``[num_pages, page_size, num_kv_heads, head_dim]`` (a view)."""
        return self._paged(1, layer)

    # -- write / read ----------------------------------------------------------------------

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store ``key[i]`` and ``value[i]`` (``[num_kv_heads, head_dim]``) at ``slots[i]``.

        Preconditions: ``slots`` is ``[N]`` integer with distinct values in
        ``[0, num_slots)``, as :meth:`prepare` checks a step's slot mapping once before its
        writes; ``key`` and ``value`` are ``[N, num_kv_heads, head_dim]``. They are cast to
        the pool dtype and detached from autograd. Nothing here synchronises with the device.

        Raises:
            InvalidRequest: a layer or shape out of range, or (on the CPU, where the copy
                reports it; possibly after writing the slots before it) a slot.
        """
        self._check_layer(layer)
        index = self._slot_index(slots)
        expected = (index.shape[0], self._config.num_kv_heads, self._config.head_dim)
        for name, tensor in (("key", key), ("value", value)):
            if tuple(tensor.shape) != expected:
                raise InvalidRequest(
                    f"{name} must be shaped {list(expected)}, got {list(tensor.shape)}"
                )
        pool_dtype = self._dtype
        try:
            self._flat(0, layer).index_copy_(0, index, key.detach().to(pool_dtype))
            self._flat(1, layer).index_copy_(0, index, value.detach().to(pool_dtype))
        except IndexError as exc:
            raise InvalidRequest(f"slots outside 0..{self._num_slots - 1}: {exc}") from exc

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V stored at ``slots``, each ``[len(slots), num_kv_heads, head_dim]``.

        Raises:
            InvalidRequest: a layer or slot out of range.
        """
        self._check_layer(layer)
        index = self._slot_index(slots)
        check_range(index, self._num_slots, "slots")
        return (
            gather_rows(self._flat(0, layer), index),
            gather_rows(self._flat(1, layer), index),
        )

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Make page ``dst[i]`` hold, in every layer, the K and V page ``src[i]`` held before
        the call (PST-006): a fork's partial page becoming the new sequence's own.

        Checks its arguments where they lie. Given host tensors (the plan's host copy,
        :attr:`~pagedkv.plan.StepPlan.page_copies_on_host`, as the runner gives them), it
        reads nothing back from the device and moves the slots to copy in one copy, non-blocking
        on CUDA (PST-055); given device tensors, the checks synchronise with the device once.

        Raises:
            InvalidRequest: ``src`` and ``dst`` not 1-D integer tensors of equal length, a page
                outside the pool, a ``dst`` page named twice or also a ``src`` page.
        """
        for given in (src, dst):
            _check_index_kind(given)
        if src.shape != dst.shape:
            raise InvalidRequest(f"{src.shape[0]} source pages for {dst.shape[0]} targets")
        if not src.numel():
            return
        on_host = src.device.type == "cpu" and dst.device.type == "cpu"
        source = src.to(torch.int64) if on_host else self._slot_index(src)
        target = dst.to(torch.int64) if on_host else self._slot_index(dst)
        pages = self._config.num_pages
        check_range(source, pages, "source pages")
        check_range(target, pages, "target pages")
        names = target.tolist()
        if len(set(names)) != len(names) or set(names) & set(source.tolist()):
            raise InvalidRequest(f"target pages {names} repeat or overlap the source pages")
        page_size = self._config.page_size
        offsets = torch.arange(page_size, device=source.device)
        to_slots = (target[:, None] * page_size + offsets).flatten()
        from_slots = (source[:, None] * page_size + offsets).flatten()
        if on_host and self._device.type != "cpu":
            to_slots, from_slots = move_once([to_slots, from_slots], self._device)
        for pool in self._pools:
            pool.index_copy_(0, to_slots, pool.index_select(0, from_slots))

    # -- attention ---------------------------------------------------------------------------

    def prepare(self, batch: AttentionBatch) -> PagedAttentionMetadata:
        """Check ``batch`` once and lay out its attention for every layer of the step (PST-016).

        Sequence ``b`` owns query rows ``query_start[b]:query_start[b+1]``: its last ``q_len``
        positions of ``context_len``. Its K/V are gathered through its page table only up to
        ``context_len`` (PST-020). Every host-side computation of the step happens here.

        Raises:
            InvalidRequest: no page tables (a cache-less batch); offsets not ``[B+1]`` from 0;
                a sequence with no rows, more rows than context, or more context than its page
                table holds; a page, or a slot of ``batch.slot_mapping``, outside the pool.
        """
        starts, contexts, _ = check_paged_batch(
            batch, self._config, self._num_slots, self._slot_index
        )
        page_size = self._config.page_size
        host_tables = batch.on_host.page_tables
        if host_tables is None:  # check_paged_batch refused it already
            raise InvalidRequest("paged attention needs page tables; the batch has none (v0)")
        # Every group's slots are made from the host copy of the tables and reach the device
        # in one copy (PST-054), never a copy per tensor from pageable memory.
        tables = host_tables.to(dtype=torch.int64)

        def slots_of(seqs: list[int], width: int) -> torch.Tensor:
            positions = torch.arange(width)
            ids = torch.tensor(seqs, dtype=torch.int64)
            pages = tables.index_select(0, ids)[:, positions // page_size]
            return pages * page_size + positions % page_size

        layout = plan_attention(
            starts, contexts, slots_of, self._device, decode_fill=self._decode_fill
        )
        return PagedAttentionMetadata(num_slots=self._num_slots, layout=layout)

    def attention(
        self,
        layer: int,
        query: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, num_heads, head_dim]`` over paged K/V, laid out
        by :meth:`prepare`.

        Sequence ``b``'s row ``j`` sees positions ``0..context_len - q_len + j`` (PST-011).
        Decode tokens of close context lengths share a padded gather (PST-017) whose padding
        re-reads the sequence's position 0 and is masked out, so stale slot contents never
        reach the result (PST-013); prefill chunks of equal shape share a call. ``num_heads``
        must be a multiple of ``num_kv_heads`` (GQA). No host synchronisation.

        Returns:
            ``[T, num_heads, head_dim]`` in ``query``'s dtype.

        Raises:
            InvalidRequest: metadata not prepared by a store of this pool's geometry, or a
                layer or query shape out of range.
        """
        self._check_layer(layer)
        if (
            not isinstance(metadata, PagedAttentionMetadata)
            or metadata.num_slots != self._num_slots
        ):
            raise InvalidRequest("the metadata was not prepared by a store of this pool")
        if query.dim() != 3 or query.shape[2] != self._config.head_dim:
            raise InvalidRequest(
                f"query must be [T, num_heads, {self._config.head_dim}], got {list(query.shape)}"
            )
        if query.shape[1] % self._config.num_kv_heads != 0:
            raise InvalidRequest(
                f"num_heads={query.shape[1]} is not a multiple of "
                f"num_kv_heads={self._config.num_kv_heads}"
            )
        if metadata.layout.num_rows != query.shape[0]:
            raise InvalidRequest(
                f"the batch covers {metadata.layout.num_rows} query rows, query has "
                f"{query.shape[0]}"
            )
        return ragged_attention(
            query, self._flat(0, layer), self._flat(1, layer), metadata.layout, scale, self._decode
        )

    # -- helpers ----------------------------------------------------------------------------

    def _flat(self, kv: int, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K (``kv=0``) or V (``kv=1``) pool, ``[num_slots, heads, dim]``:
        the tensor itself, so that writes into it stay in place under ``torch.compile``."""
        return self._pools[2 * layer + kv]

    def _paged(self, kv: int, layer: int) -> torch.Tensor:
        """:meth:`_flat` viewed as ``[num_pages, page_size, heads, dim]``."""
        self._check_layer(layer)
        c = self._config
        return self._flat(kv, layer).view(c.num_pages, c.page_size, c.num_kv_heads, c.head_dim)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self._config.num_layers:
            raise InvalidRequest(f"layer {layer} outside 0..{self._config.num_layers - 1}")

    def _slot_index(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` as an int64 index on the pool's device; its values are not checked."""
        _check_index_kind(slots)
        return slots.to(device=self._device, dtype=torch.int64)


def _check_index_kind(slots: torch.Tensor) -> None:
    """Raise unless ``slots`` is a 1-D integer tensor: its kind, never its values.

    Raises:
        InvalidRequest: another dtype or shape.
    """
    if slots.dim() != 1 or slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise InvalidRequest(
            f"slots must be a 1-D integer tensor, got {slots.dtype} {list(slots.shape)}"
        )
