"""A PagedStore that writes and attends through the Triton kernels, over a reference store's
pools.

It holds the :class:`~pagedkv.store.paged_store.TorchPagedStore` it is built over and its
pools, never copies of them: ``read`` and ``copy_pages`` are the reference store's, ``write``
is the store kernel (:mod:`.store_kernel`), ``attention`` the split-K decode kernel
(:mod:`.decode_kernel`) for sequences of one query row and the varlen kernel
(:mod:`.prefill_kernel`) for the others, each one launch per layer for all its sequences.
Nothing is gathered and nothing padded: the kernels read each context through its page table,
up to its length. Like the reference store it decides no ownership: it writes at the slots and
reads through the page tables it is given (PST-030).

Each step, :meth:`TritonPagedStore.prepare` checks the batch as the reference store does
(PST-003), reading only the host copy of the batch (PST-051), and moves the step's offsets,
lengths and page tables to the pools' device in one non-blocking copy from pinned memory
(PST-052); ``write`` and ``attention`` then read no value on the host (PST-016).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.accel.cuda.decode_kernel import paged_decode
from pagedkv.accel.cuda.kernel_shapes import decode_splits
from pagedkv.accel.cuda.prefill_kernel import paged_prefill
from pagedkv.accel.cuda.store_kernel import runs_interpreted, store_kv
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch, AttentionMetadata, StoreConfig
from pagedkv.store.batch_check import check_paged_batch
from pagedkv.store.one_copy import move_once
from pagedkv.store.paged_store import TorchPagedStore


@dataclass(frozen=True, slots=True)
class TritonAttentionMetadata:
    """What :meth:`TritonPagedStore.prepare` laid out for one step, on the pools' device.
    Immutable; valid for any store of the same pool geometry.

    Attributes:
        num_slots: slots per layer of the pool it was prepared for.
        num_rows: query rows of the step.
        query_start: ``[B+1]`` int32 row offsets.
        context_lens: ``[B]`` int32 positions of each sequence.
        page_tables: ``[B, max_pages]`` int32 pages.
        decode_seqs: ``[n]`` int32 sequences of one query row.
        decode_rows: ``[n]`` int32 their rows.
        prefill_seqs: ``[m]`` int32 sequences of several rows.
        longest_chunk: the most rows of a sequence in ``prefill_seqs`` (0 when there is none).
        decode_splits: splits of each decoding context
            (:func:`~pagedkv.accel.cuda.kernel_shapes.decode_splits` of the longest).
    """

    num_slots: int
    num_rows: int
    query_start: torch.Tensor
    context_lens: torch.Tensor
    page_tables: torch.Tensor
    decode_seqs: torch.Tensor
    decode_rows: torch.Tensor
    prefill_seqs: torch.Tensor
    longest_chunk: int
    decode_splits: int


class TritonPagedStore:
    """The PagedStore of ``attention="triton"``: ``store``'s pools, written and attended by
    Triton kernels.

    Args:
        store: the reference store whose pools it uses; it is not changed, and both may be
            used (a step written through one is read the same through the other).
    """

    def __init__(self, store: TorchPagedStore) -> None:
        self._store = store
        config = store.config
        self._pools = tuple(
            (
                store.key_pool(layer).flatten(0, 1),
                store.value_pool(layer).flatten(0, 1),
            )
            for layer in range(config.num_layers)
        )
        self._device = self._pools[0][0].device
        self._interpreted = runs_interpreted()

    @property
    def config(self) -> StoreConfig:
        """The pool's shape."""
        return self._store.config

    @property
    def reference(self) -> TorchPagedStore:
        """The store whose pools these are."""
        return self._store

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store ``key[i]`` and ``value[i]`` (``[num_kv_heads, head_dim]``) at ``slots[i]``
        in one launch of the store kernel; a row whose slot is negative is a padded row and is
        not written (PST-042).

        Preconditions: the non-negative slots are distinct and lie in the pool, as
        :meth:`prepare` checks a step's slot mapping once. On a CPU pool (the interpreter) a
        slot past the pool raises here, as the reference store's copy does; on a GPU nothing
        is read on the host.

        Raises:
            InvalidRequest: a layer or shape out of range, slots that are not a 1-D integer
                tensor, or (on the CPU) a slot past the pool.
        """
        keys, values = self._layer(layer)
        index = self._slot_index(slots)
        config = self.config
        expected = (index.shape[0], config.num_kv_heads, config.head_dim)
        for name, tensor in (("key", key), ("value", value)):
            if tuple(tensor.shape) != expected:
                raise InvalidRequest(
                    f"{name} must be shaped {list(expected)}, got {list(tensor.shape)}"
                )
        if self._device.type == "cpu" and index.numel():
            # Read by a native check, not in Python: the interpreter would write past the pool.
            try:
                torch._assert_async((index < self._store.num_slots).all())
            except RuntimeError as exc:
                raise InvalidRequest(f"slots past {self._store.num_slots - 1}") from exc
        store_kv(
            key.detach().to(self._device),
            value.detach().to(self._device),
            keys,
            values,
            index,
        )

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference store's :meth:`~TorchPagedStore.read` of the same pools."""
        return self._store.read(layer, slots)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The reference store's :meth:`~TorchPagedStore.copy_pages` of the same pools."""
        self._store.copy_pages(src, dst)

    def prepare(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        """Check ``batch`` once, as the reference store does, and move what the kernels read to
        the pools' device (PST-016).

        Raises:
            InvalidRequest: no page tables; offsets not ``[B+1]`` from 0; a sequence with no
                rows, more rows than context, or more context than its page table holds; a
                page, or a slot of ``batch.slot_mapping``, outside the pool.
        """
        config = self.config
        starts, contexts, tables = check_paged_batch(
            batch, config, self._store.num_slots, self._slot_index
        )
        num_seqs = len(contexts)
        q_lens = [starts[b + 1] - starts[b] for b in range(num_seqs)]
        decode = [b for b in range(num_seqs) if q_lens[b] == 1]
        prefill = [b for b in range(num_seqs) if q_lens[b] > 1]

        # Everything the kernels read, in one int32 host buffer (pinned on CUDA) moved to the
        # device in one non-blocking copy (PST-052); a buffer of its own each step, since the
        # metadata is immutable. The tables come from the batch's host copy, so nothing is
        # read back from the device (PST-051).
        host_tables = batch.on_host.page_tables
        if host_tables is None:  # check_paged_batch refused it already
            raise InvalidRequest("paged attention needs page tables; the batch has none (v0)")
        columns = tables.shape[1]
        small = starts + contexts + decode + [starts[b] for b in decode] + prefill
        lengths = [num_seqs + 1, num_seqs, len(decode), len(decode), len(prefill)]
        packed = move_once(
            [
                torch.tensor(small, dtype=torch.int32),
                host_tables.to(dtype=torch.int32).flatten(),
            ],
            self._device,
        )
        parts = torch.split(packed[0], lengths)
        return TritonAttentionMetadata(
            num_slots=self._store.num_slots,
            num_rows=starts[-1],
            query_start=parts[0],
            context_lens=parts[1],
            page_tables=packed[1].view(num_seqs, columns),
            decode_seqs=parts[2],
            decode_rows=parts[3],
            prefill_seqs=parts[4],
            longest_chunk=max((q_lens[b] for b in prefill), default=0),
            decode_splits=decode_splits(max((contexts[b] for b in decode), default=1)),
        )

    def attention(
        self,
        layer: int,
        query: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, num_heads, head_dim]`` over the paged K/V, laid
        out by :meth:`prepare`: the decode kernel for sequences of one row, the varlen kernel
        for the others (PST-043, PST-044). No host synchronisation.

        Returns:
            ``[T, num_heads, head_dim]`` in ``query``'s dtype.

        Raises:
            InvalidRequest: metadata not prepared by a store of this pool's geometry, or a
                layer or query shape out of range.
        """
        keys, values = self._layer(layer)
        config = self.config
        if (
            not isinstance(metadata, TritonAttentionMetadata)
            or metadata.num_slots != self._store.num_slots
        ):
            raise InvalidRequest("the metadata was not prepared by a store of this pool")
        if query.dim() != 3 or query.shape[2] != config.head_dim:
            raise InvalidRequest(
                f"query must be [T, num_heads, {config.head_dim}], got {list(query.shape)}"
            )
        if query.shape[1] % config.num_kv_heads != 0:
            raise InvalidRequest(
                f"num_heads={query.shape[1]} is not a multiple of "
                f"num_kv_heads={config.num_kv_heads}"
            )
        if metadata.num_rows != query.shape[0]:
            raise InvalidRequest(
                f"the batch covers {metadata.num_rows} query rows, query has {query.shape[0]}"
            )
        query = query.to(self._device)
        if query.stride(-1) != 1:
            query = query.contiguous()
        # Triton's interpreter truncates float32 to 16 bits where a GPU rounds to nearest:
        # interpreted, the kernels write float32 and torch rounds (PST-047).
        rounded_here = self._interpreted and query.dtype != torch.float32
        out_dtype = torch.float32 if rounded_here else query.dtype
        out = torch.empty(query.shape, dtype=out_dtype, device=self._device)
        paged_decode(
            query,
            keys,
            values,
            metadata.page_tables,
            metadata.context_lens,
            metadata.decode_rows,
            metadata.decode_seqs,
            out,
            scale,
            config.page_size,
            metadata.decode_splits,
        )
        paged_prefill(
            query,
            keys,
            values,
            metadata.page_tables,
            metadata.context_lens,
            metadata.query_start,
            metadata.prefill_seqs,
            metadata.longest_chunk,
            out,
            scale,
            config.page_size,
            upcast=self._interpreted and keys.dtype == torch.bfloat16,
        )
        return out.to(query.dtype) if rounded_here else out

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s flat K and V pools, ``[num_slots, kv_heads, head_dim]``.

        Raises:
            InvalidRequest: no such layer.
        """
        if not 0 <= layer < len(self._pools):
            raise InvalidRequest(f"layer {layer} outside 0..{len(self._pools) - 1}")
        return self._pools[layer]

    def _slot_index(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` on the pools' device, in their own integer width; values unchecked.

        Raises:
            InvalidRequest: not a 1-D integer tensor.
        """
        if slots.dim() != 1 or slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise InvalidRequest(
                f"slots must be a 1-D integer tensor, got {slots.dtype} {list(slots.shape)}"
            )
        return slots.to(device=self._device)
