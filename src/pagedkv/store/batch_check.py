"""The checks every paged store makes of a step's attention batch, once, in ``prepare``.

Why one place: a store backend that substitutes the reference's kernels (the Triton store)
must refuse exactly what the reference refuses (PST-016); two copies of these checks would
drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch, StoreConfig


def check_range(values: torch.Tensor, bound: int, what: str) -> None:
    """Raise unless every value is in ``[0, bound)``: a host synchronisation, so only a
    store's ``prepare`` (once a step) and ``read`` call it.

    Raises:
        InvalidRequest: a value outside.
    """
    if values.numel():
        low, high = (int(x) for x in torch.aminmax(values))
        if low < 0 or high >= bound:
            raise InvalidRequest(f"{what} {low}..{high}, outside 0..{bound - 1}")


def check_paged_batch(
    batch: AttentionBatch,
    config: StoreConfig,
    num_slots: int,
    slot_index: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[list[int], list[int], torch.Tensor]:
    """The query offsets (``[B+1]``), context lengths (``[B]``) and page tables
    (``[B, max_pages]``, as given) of ``batch``, checked.

    Sequence ``b`` owns query rows ``starts[b]:starts[b+1]``: its last ``q_len`` positions of
    ``contexts[b]``, which its page table must hold. ``slot_index`` turns a slot mapping into
    the store's index tensor (refusing a tensor of the wrong kind).

    Every value is read from ``batch.on_host``: a batch the plan builders moved to a device
    carries its host copy, and the checks read that, never the device's tensors (PST-051),
    after checking that the copy has the batch's shapes (PST-053), which reads no value.

    Raises:
        InvalidRequest: no page tables (a cache-less batch); offsets not ``[B+1]`` from 0;
            a sequence with no rows, more rows than context, or more context than its page
            table holds; a page, or a slot of ``batch.slot_mapping``, outside the pool.
    """
    if batch.page_tables is None:
        raise InvalidRequest("paged attention needs page tables; the batch has none (v0)")
    host = batch.on_host
    check_host_copy(batch)
    starts = [int(x) for x in host.query_start.tolist()]
    contexts = [int(x) for x in host.context_lens.tolist()]
    tables = host.page_tables
    if tables is None:
        raise InvalidRequest("the batch's host copy has no page tables")
    num_seqs = len(contexts)
    if len(starts) != num_seqs + 1 or starts[0] != 0:
        raise InvalidRequest(
            f"query_start must be [B+1] offsets from 0; got {starts} for B={num_seqs}"
        )
    if tables.dim() != 2 or tables.shape[0] != num_seqs:
        raise InvalidRequest(f"page_tables must be [{num_seqs}, max_pages]")
    check_range(tables, config.num_pages, "page tables name pages")
    capacity = tables.shape[1] * config.page_size
    for b in range(num_seqs):
        q_len = starts[b + 1] - starts[b]
        if not 1 <= q_len <= contexts[b] <= capacity:
            raise InvalidRequest(
                f"sequence {b}: need 1 <= q_len ({q_len}) <= context_len ({contexts[b]}) "
                f"<= page table capacity ({capacity})"
            )
    if batch.slot_mapping is not None:
        slot_index(batch.slot_mapping)  # refuses a tensor of the wrong kind; reads no value
        slots = host.slot_mapping
        if slots is None or slots.shape[0] != starts[-1]:
            given = 0 if slots is None else slots.shape[0]
            raise InvalidRequest(f"slot_mapping has {given} slots for {starts[-1]} query rows")
        check_range(slots, num_slots, "slots")
    return starts, contexts, batch.page_tables


def check_host_copy(batch: AttentionBatch) -> None:
    """Raise unless ``batch.host`` (when there is one) has ``batch``'s shapes, tensor by
    tensor, and lies on the CPU (PST-053): reading shapes and devices reads no value.

    Raises:
        InvalidRequest: a host copy of other shapes, or not on the CPU.
    """
    host = batch.host
    if host is None:
        return
    pairs = (
        ("query_start", batch.query_start, host.query_start),
        ("context_lens", batch.context_lens, host.context_lens),
        ("page_tables", batch.page_tables, host.page_tables),
        ("slot_mapping", batch.slot_mapping, host.slot_mapping),
    )
    for name, given, copy in pairs:
        if (given is None) != (copy is None):
            raise InvalidRequest(f"the batch's host copy has {name} where the batch has not")
        if given is None or copy is None:
            continue
        if copy.device.type != "cpu" or copy.shape != given.shape:
            raise InvalidRequest(
                f"the host copy's {name} is {list(copy.shape)} on {copy.device}; the batch's "
                f"is {list(given.shape)}"
            )
