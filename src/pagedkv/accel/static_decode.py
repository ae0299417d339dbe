"""Decode steps of fixed shapes: replayed from CUDA graphs, or compiled once per shape.

A decode step (every sequence computes one token) is run on buffers of a fixed size: ``Bp``
rows, the batch size padded up to the next of the captured sizes 1, 2, 4, ... up to the largest
batch (:func:`capture_sizes`, :func:`padded_size`; ENG-206), and a gather ``Wp`` positions wide,
the longest context rounded up to a power of two (at least :data:`MIN_WIDTH`). Each
``(Bp, Wp)`` has its own buffers and its own runner of the step:

* on CUDA, a CUDA graph captured on first use and replayed after (one launch per step, no
  Python per layer, no host synchronisation inside), every graph of one runner captured into
  one memory pool (replays never overlap, and each step's output is copied into buffers
  allocated outside the pool, so the graphs may share their temporaries);
* elsewhere, the step run eagerly or, with ``compile``, a ``torch.compile`` of it (inductor,
  the weights frozen into it as constants and packed), compiled on first use of the shape.

Padding rows repeat row 0: the same token at the same position over the same context, so they
compute row 0's K/V (to the last bit or nearly: a kernel may round rows of different tiles
differently) and write it to row 0's slot; row 0's own K/V is then written again, alone, so the
slot ends up holding exactly row 0's values whatever order the first writes land in. Padding
rows' logits are dropped. Gather positions past a sequence's
context re-read its position 0 and are masked, as in :mod:`pagedkv.store.ragged_attention`.

Before a step runs, the runner has already checked its plan against the store
(``PagedStore.prepare``): this module trusts the plan's ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch._inductor import config as inductor_config

from pagedkv.accel.cuda.graphs import capture_pool, captured
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import AttentionBatch, AttentionMetadata, PagedStore
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.plan import StepPlan
from pagedkv.store.paged_store import PagedAttentionMetadata, TorchPagedStore
from pagedkv.store.ragged_attention import AttentionGroup, AttentionLayout

#: Narrowest gather of a static decode step, positions.
MIN_WIDTH = 64


def bucket(n: int, least: int = 1) -> int:
    """``n`` rounded up to a power of two, at least ``least``."""
    size = least
    while size < n:
        size *= 2
    return size


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes decode steps run at: 1, 2, 4, ... below ``max_batch``, and
    ``max_batch`` itself (ENG-206).

    Raises:
        InvalidRequest: ``max_batch`` below 1.
    """
    if max_batch < 1:
        raise InvalidRequest(f"the largest captured batch must be >= 1, got {max_batch}")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def padded_size(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``batch`` sequences; ``None`` when
    none does (the batch runs the ordinary path)."""
    for size in sizes:
        if size >= batch:
            return size
    return None


class StaticDecodePath(Protocol):
    """A runner's fixed-shape decode steps: :class:`StaticDecode` over the reference store,
    or :class:`~pagedkv.accel.cuda.triton_static_decode.TritonStaticDecode` over the Triton
    store (chosen by :func:`~pagedkv.accel.cuda.attention_choice.static_decode_for`)."""

    def fits(self, plan: StepPlan, metadata: AttentionMetadata) -> bool:
        """Whether ``plan`` (prepared as ``metadata``) is a step this path runs."""
        ...

    def run(self, plan: StepPlan, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32, on the model's device) of a plan that fits."""
        ...


@dataclass(frozen=True, slots=True)
class _Buffers:
    """The fixed tensors of one ``(Bp, Wp)`` shape; every step copies its plan into them."""

    input_ids: torch.Tensor  # [Bp]
    positions: torch.Tensor  # [Bp]
    slots: torch.Tensor  # [Bp]
    context_lens: torch.Tensor  # [Bp]
    page_tables: torch.Tensor  # [Bp, ceil(Wp / page_size)]
    rows: torch.Tensor  # [Bp] = arange(Bp)
    kv_index: torch.Tensor  # [Bp, Wp]
    mask: torch.Tensor  # [Bp, 1, 1, Wp]
    logits: torch.Tensor  # [Bp, vocab] float32

    @classmethod
    def allocate(
        cls, rows: int, width: int, page_size: int, vocab: int, device: torch.device
    ) -> _Buffers:
        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(
            input_ids=ints(rows),
            positions=ints(rows),
            slots=ints(rows),
            context_lens=ints(rows),
            page_tables=ints(rows, -(-width // page_size)),
            rows=torch.arange(rows, device=device),
            kv_index=ints(rows, width),
            mask=torch.zeros(rows, 1, 1, width, dtype=torch.bool, device=device),
            logits=torch.zeros(rows, vocab, dtype=torch.float32, device=device),
        )


@dataclass(frozen=True, slots=True)
class _PaddedStepAttention:
    """The step attention of a padded batch: every row's K/V written, then row 0's again."""

    store: TorchPagedStore
    metadata: PagedAttentionMetadata
    slots: torch.Tensor

    def __call__(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        self.store.write(layer, self.slots, key, value)
        self.store.write(layer, self.slots[:1], key[:1], value[:1])  # row 0's own values last
        return self.store.attention(layer, query, self.metadata, scale)


class StaticDecode:
    """Runs decode-only plans on fixed shapes (see the module docstring).

    Args:
        model: the model.
        store: its K/V pool (the reference store: the step reads its pools directly).
        max_batch: the largest batch run this way; larger ones run the ordinary path.
        max_width: the longest context run this way.
        cuda_graphs: capture and replay CUDA graphs (the model must be on a CUDA device).
        compile: run each shape's step through ``torch.compile`` (the runner refuses it with
            ``cuda_graphs``).
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        store: TorchPagedStore,
        *,
        max_batch: int,
        max_width: int,
        cuda_graphs: bool,
        compile: bool,
    ) -> None:
        self.model = model
        self.store = store
        self.max_batch = max_batch
        self.batch_sizes = capture_sizes(max_batch)
        self.max_width = max_width
        self.cuda_graphs = cuda_graphs
        self.compile = compile and not cuda_graphs
        self._steps: dict[tuple[int, int], tuple[_Buffers, Callable[[], None]]] = {}
        self._pool: object | None = None  # shared by every capture; made at the first

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The ``(Bp, Wp)`` shapes prepared so far."""
        return sorted(self._steps)

    def fits(self, plan: StepPlan, metadata: AttentionMetadata) -> bool:
        """Whether ``plan`` is a decode step this object runs: one row per sequence, the last
        row's logits of each, at most ``max_batch`` sequences and ``max_width`` context,
        prepared by the reference store."""
        if not isinstance(metadata, PagedAttentionMetadata):
            return False
        rows, seqs = plan.num_tokens, plan.num_seqs
        if rows != seqs or not 1 <= seqs <= self.max_batch:
            return False
        return max(g.width for g in metadata.layout.groups) <= self.max_width

    def run(self, plan: StepPlan, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32, on the model's device) of a plan that :meth:`fits`.

        Raises:
            InvalidRequest: metadata not prepared by the reference store.
        """
        if not isinstance(metadata, PagedAttentionMetadata):
            raise InvalidRequest("a static decode step reads the reference store's metadata")
        seqs = plan.num_seqs
        width = max(g.width for g in metadata.layout.groups)
        rows = padded_size(seqs, self.batch_sizes)
        if rows is None:
            raise InvalidRequest(f"a static decode step takes at most {self.max_batch} sequences")
        key = (rows, bucket(width, MIN_WIDTH))
        if key in self._steps:
            buffers, step = self._steps[key]
            self._fill(buffers, plan)
        else:
            # Filled before the step is built: a CUDA graph's warm-up runs the step for real,
            # and on this plan's buffers they write only this plan's slots, with the values the
            # step writes again below. On empty buffers they would write slot 0 of the pool,
            # which may hold another sequence's K/V.
            buffers = self._allocate(*key)
            self._fill(buffers, plan)
            step = self._build(buffers)
            self._steps[key] = (buffers, step)
        step()
        return buffers.logits[:seqs]

    def _fill(self, buffers: _Buffers, plan: StepPlan) -> None:
        """Copy the plan into the buffers, padding rows repeating row 0 (no host sync)."""
        batch = plan.attention
        if batch.page_tables is None or batch.slot_mapping is None:
            raise InvalidRequest("a static decode step needs a v1 plan (page tables and slots)")
        seqs = plan.num_seqs
        source = torch.where(buffers.rows < seqs, buffers.rows, 0)  # padding -> row 0
        buffers.input_ids.copy_(plan.input_ids.index_select(0, source))
        buffers.positions.copy_(plan.positions.index_select(0, source))
        buffers.slots.copy_(batch.slot_mapping.index_select(0, source))
        page_size = self.store.config.page_size
        tables = batch.page_tables.to(torch.int64).index_select(0, source)
        pages = torch.arange(buffers.page_tables.shape[1], device=tables.device)
        buffers.page_tables.copy_(tables[:, torch.clamp(pages, max=tables.shape[1] - 1)])
        buffers.context_lens.copy_(batch.context_lens.index_select(0, source))
        positions = torch.arange(buffers.kv_index.shape[1], device=tables.device)
        slots = buffers.page_tables[:, positions // page_size] * page_size + positions % page_size
        inside = positions[None, :] < buffers.context_lens[:, None]
        buffers.kv_index.copy_(torch.where(inside, slots, slots[:, :1]))
        buffers.mask.copy_(inside[:, None, None, :])

    def _allocate(self, rows: int, width: int) -> _Buffers:
        device = self.store.key_pool(0).device
        page_size = self.store.config.page_size
        return _Buffers.allocate(rows, width, page_size, self.model.config.vocab_size, device)

    def _build(self, buffers: _Buffers) -> Callable[[], None]:
        """The step over ``buffers`` (already holding a plan: see :meth:`run`)."""
        rows, width = buffers.kv_index.shape
        device = buffers.kv_index.device
        group = AttentionGroup(
            num_seqs=rows,
            q_len=1,
            width=width,
            rows=buffers.rows,
            span=(0, rows),
            kv_index=buffers.kv_index,
            mask=buffers.mask,
            is_causal=False,
            context_lens=buffers.context_lens,
        )
        metadata = PagedAttentionMetadata(
            num_slots=self.store.num_slots, layout=AttentionLayout(rows, (group,))
        )
        attention = _PaddedStepAttention(self.store, metadata, buffers.slots)
        plan = StepPlan(
            input_ids=buffers.input_ids,
            positions=buffers.positions,
            attention=AttentionBatch(
                query_start=torch.arange(rows + 1, device=device),
                context_lens=buffers.context_lens,
                page_tables=buffers.page_tables,
                slot_mapping=buffers.slots,
            ),
            logits_indices=buffers.rows,
        )

        def step() -> None:
            buffers.logits.copy_(self.model(plan, attention))

        if self.cuda_graphs:
            if self._pool is None:
                self._pool = capture_pool()
            return captured(step, device, self._pool)
        if self.compile:
            return _frozen(torch.compile(step, dynamic=False))
        return step


def _frozen(compiled: Callable[[], None]) -> Callable[[], None]:
    """``compiled`` run with inductor's freezing on (ENG-115): its first call traces the step
    with the weights as constants, so inductor packs them for its linear kernels (oneDNN in
    16-bit), as the eager path's packing does. Dynamo reads the setting while it traces, before
    ``torch.compile``'s own options reach inductor (freezing given there does nothing), hence
    the patch around every call (16 us, against a step of tens of milliseconds); it is
    restored on return."""

    def run() -> None:
        with inductor_config.patch(freezing=True):
            compiled()

    return run


#: Largest decode batch run by :class:`StaticDecode` of a runner built without an engine and
#: without ``max_decode_batch`` (larger ones take the ordinary path); an engine's runner runs
#: up to its ``max_num_seqs`` (ENG-226).
STATIC_MAX_BATCH = 256


def resolve_cuda_graphs(
    options: RunnerOptions, model: Qwen3ForCausalLM, store: PagedStore | None
) -> RunnerOptions:
    """``options`` with ``cuda_graphs`` decided (ENG-205): as given when set; unset, on for a
    v1 runner over the reference store, or over the Triton store of ``attention="triton"``
    (ENG-228), whose model is on a CUDA device, whole (one rank) and not compiled, off
    elsewhere."""
    if options.cuda_graphs is not None:
        return options
    device = next(model.parameters()).device
    wanted = (
        device.type == "cuda"
        and store is not None
        and (isinstance(store, TorchPagedStore) or options.attention == "triton")
        and not options.compile
        and model.layout.size == 1
    )
    return replace(options, cuda_graphs=wanted)


def static_store(
    model: Qwen3ForCausalLM, store: PagedStore | None, options: RunnerOptions
) -> PagedStore | None:
    """The store whose pools the fixed-shape decode steps of ``options`` read, or ``None``
    where they are off.

    Raises:
        InvalidRequest: ``compile`` with ``cuda_graphs`` (a step is captured or compiled,
            not both), CUDA graphs on a model not on a CUDA device, or a store other than
            the reference one (whose pools the captured step reads) or the Triton store of
            ``attention="triton"`` (whose steps are captured, never compiled: ENG-199).
    """
    if not (options.compile or options.cuda_graphs) or store is None:
        return None
    if options.compile and options.cuda_graphs:
        raise InvalidRequest("compile and cuda_graphs exclude each other: choose one")
    device = next(model.parameters()).device
    if options.cuda_graphs and device.type != "cuda":
        raise InvalidRequest(f"cuda_graphs needs a model on a CUDA device, not {device}")
    if not isinstance(store, TorchPagedStore) and options.attention != "triton":
        raise InvalidRequest(
            "cuda_graphs and compile need pagedkv's TorchPagedStore (or, for cuda_graphs, "
            "attention='triton' over it)"
        )
    return store


def static_decode_over(
    model: Qwen3ForCausalLM, store: TorchPagedStore, options: RunnerOptions
) -> StaticDecode:
    """The fixed-shape decode path of ``options`` for ``model`` over the reference ``store``:
    batches up to ``options.max_decode_batch`` (ENG-226), else :data:`STATIC_MAX_BATCH`."""
    config = store.config
    return StaticDecode(
        model,
        store,
        max_batch=options.max_decode_batch or STATIC_MAX_BATCH,
        max_width=min(model.config.max_positions, config.num_pages * config.page_size),
        cuda_graphs=options.cuda_graphs is True,
        compile=options.compile,
    )
