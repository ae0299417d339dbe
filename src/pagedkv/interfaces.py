"""The Protocols that separate pagedkv's rooms, and the frozen objects that cross between them.

Three separations carry the design (see ``specs/``):

* logical vs physical: a sequence sees token positions ``0..n``; only its :class:`PageTable`
  knows which physical page holds each one;
* resources vs storage: a :class:`KVManager` owns pages, reference counts, prefix reuse and
  eviction and never touches a tensor; a :class:`PagedStore` writes K/V into page tensors and
  reads them back for attention and never decides who owns a page;
* orchestration vs computation: an :class:`Engine` decides what runs each step and hands the
  model an explicit plan.

This module must stay importable without torch, so a KVManager backend never pulls it in. It
imports nothing that stands above it: the step's data (:class:`~pagedkv.plan.StepPlan` and its
:class:`~pagedkv.plan.AttentionBatch`) comes from the torch-free :mod:`pagedkv.plan`, and the
engine's value types it names (configuration, sampling parameters, outputs, prompts, the
tokenizer) from leaf modules of :mod:`pagedkv.engine` that import none of the Protocols back
(``tests/test_layout.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pagedkv.device import DEFAULT_DEVICE
from pagedkv.errors import InvalidRequest

# The step's data is the PagedStore's and the StepRunner's contract: its name stays importable
# from here, beside the Protocols that take it.
from pagedkv.plan import AttentionBatch as AttentionBatch
from pagedkv.plan import StepPlan

if TYPE_CHECKING:
    import torch

    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.generation_config import GenerationDefaults
    from pagedkv.engine.outputs import EngineStats, RequestOutput, StepReport
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.prompts import PromptType
    from pagedkv.engine.tokenizer import Tokenizer

#: Capability names a :class:`Backend` may declare. Conformance tests that need one are skipped,
#: with the reason, for a backend that does not declare it.
CAPABILITIES: frozenset[str] = frozenset(
    {
        "prefix_caching",  # match_prefix can hit, commit publishes pages
        "eviction",  # cached free pages are evicted LRU when the free list runs dry
        "reset",  # reset_prefix_cache is supported
        "paged_store",  # create_paged_store returns a PagedStore
        "model",  # create_model_runner runs a Qwen3 checkpoint (golden tests)
        "engine",  # create_engine returns an Engine
        "cuda",  # the store / model can run on a CUDA device
        "fork",  # create_kv_manager returns a ForkingKVManager (KVM-037..039)
        "supplied_kv_manager",  # create_engine(..., kv_manager=) runs on the given manager
    }
)


@dataclass(frozen=True, slots=True)
class KVManagerConfig:
    """How a KVManager's page pool is shaped.

    Attributes:
        num_pages: physical pages in the pool, at least 1.
        page_size: token positions per page, at least 1.
        enable_prefix_caching: when false, nothing is ever published or matched, so every
            request computes its whole prompt (the baseline for comparisons).
    """

    num_pages: int
    page_size: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise InvalidRequest(f"num_pages must be >= 1, got {self.num_pages}")
        if self.page_size < 1:
            raise InvalidRequest(f"page_size must be >= 1, got {self.page_size}")


@dataclass(frozen=True, slots=True)
class PageTable:
    """One sequence's map from logical pages to physical pages (KVM-005).

    Attributes:
        seq_id: the sequence it belongs to.
        page_size: token positions per page.
        pages: ``pages[i]`` is the physical page holding logical page ``i``.
        num_tokens: token positions reserved for the sequence; ``len(pages)`` is exactly
            ``ceil(num_tokens / page_size)``.
    """

    seq_id: int
    page_size: int
    pages: tuple[int, ...]
    num_tokens: int

    def slot(self, position: int) -> int:
        """Flat slot index of token ``position``: ``page * page_size + offset`` (KVM-005)."""
        if not 0 <= position < self.num_tokens:
            raise InvalidRequest(
                f"position {position} outside the {self.num_tokens} reserved positions "
                f"of sequence {self.seq_id}"
            )
        page, offset = divmod(position, self.page_size)
        return self.pages[page] * self.page_size + offset

    def slots(self, start: int, stop: int) -> list[int]:
        """Slots of positions ``start..stop-1``, in order."""
        return [self.slot(p) for p in range(start, stop)]


@dataclass(frozen=True, slots=True)
class Allocation:
    """What :meth:`KVManager.allocate` did for a new sequence.

    Attributes:
        page_table: the sequence's page table after the call.
        num_cached_tokens: leading prompt tokens whose K/V were found in the prefix cache and
            need not be computed; a multiple of the page size, and less than the prompt length.
        num_new_pages: pages taken from the free list or by eviction (not by a prefix hit).
    """

    page_table: PageTable
    num_cached_tokens: int
    num_new_pages: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What :meth:`KVManager.match_prefix` found for a prompt: the one lookup an admission
    needs, which :meth:`KVManager.allocate` then takes instead of matching again (KVM-033..036).

    Attributes:
        token_ids: the prompt looked up.
        cache_salt: the salt it was looked up under.
        hit_pages: physical pages holding the prompt's leading committed full pages, in order:
            the pages ``allocate`` would hold (KVM-032), at most ``(len(token_ids) - 1) //
            page_size`` of them (KVM-025).
        num_cached_tokens: tokens those pages hold (``len(hit_pages) * page_size``).
        num_in_flight_tokens: tokens of the full pages right after the hits that a live
            sequence was allocated for, with the same salt and the same tokens up to the end of
            the page, and has not committed yet: they are being computed. Reported, never hit
            (KVM-021); a multiple of the page size, within the KVM-025 limit (KVM-036).
        state: opaque token of the manager's state when the match was taken. Only the manager
            that issued it reads it: ``allocate`` refuses the match with
            :class:`~pagedkv.errors.StaleMatch` once that state has changed (KVM-035).
    """

    token_ids: tuple[int, ...]
    cache_salt: str | None
    hit_pages: tuple[int, ...]
    num_cached_tokens: int
    num_in_flight_tokens: int
    state: object


@dataclass(frozen=True, slots=True)
class PageCopy:
    """A page whose K/V must be copied before a sequence uses it (KVM-037).

    Attributes:
        src: the physical page to read.
        dst: the physical page to write, a fresh page of the sequence that needs the copy.
    """

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Fork:
    """What :meth:`ForkingKVManager.fork` did.

    Attributes:
        page_table: the new sequence's page table.
        copies: pages whose K/V the caller must copy (through the PagedStore) before either
            sequence writes into them: the parent's partial last page into the new sequence's
            own page; empty when the reservation ends on a page boundary.
    """

    page_table: PageTable
    copies: tuple[PageCopy, ...]


@dataclass(frozen=True, slots=True)
class KVStats:
    """A snapshot of a KVManager's accounting (KVM-030).

    ``pages_in_use + pages_free + pages_cached == num_pages`` at every moment (KVM-010).

    Attributes:
        num_pages: pages in the pool.
        pages_in_use: pages held by at least one sequence.
        pages_free: pages on the free list: unheld and holding no reusable prefix.
        pages_cached: unheld pages that keep a published prefix entry, reusable until evicted.
        pages_indexed: pages with a published prefix entry, held or not.
        query_tokens: prompt tokens looked up by ``allocate`` since creation.
        hit_tokens: of those, tokens served from the prefix cache.
        evictions: cached pages evicted to make room since creation.
    """

    num_pages: int
    pages_in_use: int
    pages_free: int
    pages_cached: int
    pages_indexed: int
    query_tokens: int
    hit_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Hit tokens over query tokens; 0.0 before any query."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@runtime_checkable
class KVManager(Protocol):
    """The front desk: owns pages, reference counts, the prefix index and eviction.

    It never touches a tensor (KVM-040). Every method either succeeds or raises a
    :class:`~pagedkv.errors.PagedKVError` having changed nothing (KVM-001).
    """

    @property
    def page_size(self) -> int:
        """Token positions per page."""
        ...

    @property
    def num_pages(self) -> int:
        """Physical pages in the pool."""
        ...

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens ``allocate`` would serve from the cache for this prompt right now.

        A pure query: nothing moves, statistics included. Always a multiple of the page size
        and at most ``len(token_ids) - 1`` (KVM-025). Equals
        ``match_prefix(token_ids, cache_salt).num_cached_tokens`` (KVM-033).
        """
        ...

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        """Look the prompt up once: the pages ``allocate`` would hit, and the pages right after
        them that live sequences are still computing for the same prefix (KVM-033, KVM-036).

        A pure query, like :meth:`cached_prefix_length`. Pass the result to ``allocate`` to open
        the sequence without a second lookup; it is valid until the next successful
        ``allocate``, ``grow``, ``commit``, ``free`` or ``reset_prefix_cache`` (KVM-034,
        KVM-035).
        """
        ...

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        """Open sequence ``seq_id`` for the prompt ``token_ids``.

        Takes the longest verified cached prefix of full pages, then reserves pages for
        ``num_new_tokens`` more positions after it (the first prefill chunk). All or nothing:
        on :class:`~pagedkv.errors.OutOfPages` no count, page or LRU position has moved.

        With ``match`` (from :meth:`match_prefix` on this manager, for this prompt and salt, with
        no state change since) the prefix is the match's hit pages and no lookup is repeated;
        any other match raises :class:`~pagedkv.errors.StaleMatch`, changing nothing
        (KVM-034, KVM-035).

        Preconditions: ``seq_id`` holds no pages; ``token_ids`` is non-empty;
        ``num_new_tokens >= 1``.
        """
        ...

    def grow(self, seq_id: int, num_tokens: int) -> PageTable:
        """Reserve positions ``0..num_tokens-1`` for the sequence, taking pages as needed.

        ``num_tokens`` counts every position, those already reserved included, and must not be
        below the current reservation. All or nothing, like :meth:`allocate`.
        """
        ...

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Publish the full pages among the sequence's first ``len(token_ids)`` tokens.

        Call it only after the K/V of those tokens are written (KVM-021): a page is never
        visible to other requests while it is still being filled. Returns how many pages this
        call published. ``token_ids`` is the sequence's token prefix, the committed part
        included; only the pages not yet committed are hashed.
        """
        ...

    def free(self, seq_id: int) -> None:
        """Release every page of the sequence, exactly once (KVM-012).

        Unheld pages with a prefix entry become cached and evictable, the chain's tail first
        (KVM-023); others return to the free list.
        """
        ...

    def page_table(self, seq_id: int) -> PageTable:
        """The sequence's current page table."""
        ...

    def ref_count(self, page: int) -> int:
        """How many sequences hold physical page ``page``."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every prefix entry. Raises :class:`~pagedkv.errors.PagesInUse` if any page
        is held (KVM-027)."""
        ...

    def stats(self) -> KVStats:
        """A snapshot of the accounting."""
        ...

    def check_invariants(self) -> None:
        """Raise :class:`~pagedkv.errors.InvariantViolation` if any invariant fails."""
        ...


@runtime_checkable
class ForkingKVManager(KVManager, Protocol):
    """A KVManager that can fork a sequence (the ``fork`` capability, KVM-037..039).

    Parallel sampling runs ``n`` sequences from one prompt: the prompt is computed once and the
    sequence forked ``n - 1`` times, sharing its pages instead of computing them again.
    """

    def fork(self, seq_id: int, new_seq_id: int) -> Fork:
        """Open ``new_seq_id`` as a copy of live sequence ``seq_id``'s reservation.

        Every full page is shared (one more holder, nothing copied). A partial last page
        would be written by both sequences, so the new sequence gets a fresh page in its
        place and the result names the copy to make (``PageCopy(parent's page, fresh page)``);
        the manager never touches a tensor. The new sequence continues the parent's prefix
        chain: pages the parent committed count as committed for it.

        Precondition: every reserved position of ``seq_id`` has its K/V written (the caller
        forks after the step that computed them). All or nothing: an unknown or freed
        ``seq_id`` (:class:`~pagedkv.errors.UnknownSequence`,
        :class:`~pagedkv.errors.DoubleFree`), a ``new_seq_id`` that holds pages
        (:class:`~pagedkv.errors.DuplicateSequence`) or no page for the copy
        (:class:`~pagedkv.errors.OutOfPages`) raises, changing nothing (KVM-038).
        """
        ...


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Shape of a PagedStore's page pool.

    Attributes:
        num_layers: decoder layers; each has its own K and V pools.
        num_kv_heads: key/value heads per layer.
        head_dim: channels per head.
        page_size: token positions per page.
        num_pages: pages per layer pool.
        dtype: torch dtype name: ``float32``, ``bfloat16`` or ``float16``.
        device: torch device string, e.g. ``cpu`` or ``cuda:0``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: str = "float32"
    device: str = DEFAULT_DEVICE


class AttentionMetadata(Protocol):
    """What :meth:`PagedStore.prepare` returns and :meth:`PagedStore.attention` takes back for
    every layer of one step. Opaque to everyone but the store that made it: each store defines
    its own frozen type."""


@runtime_checkable
class PagedStore(Protocol):
    """The cleaner: writes K/V into page tensors at slots and reads them back for attention.

    It never decides which page belongs to whom: slots and page tables come from the plan.
    Per step: ``metadata = prepare(batch)`` once (every check and all host work), then per
    layer ``write(layer, slots, key, value)`` and ``attention(layer, query, metadata, scale)``,
    neither of which synchronises with the device (PST-016).
    """

    @property
    def config(self) -> StoreConfig:
        """The pool's shape."""
        ...

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store ``key[i]`` and ``value[i]`` (``[num_kv_heads, head_dim]``) at ``slots[i]``.

        No host synchronisation: ``slots`` must lie in the pool, which :meth:`prepare` checks
        once for a step's ``slot_mapping``."""
        ...

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V stored at ``slots``, shaped ``[len(slots), num_kv_heads, head_dim]``."""
        ...

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy, in every layer, the K and V of page ``src[i]`` into page ``dst[i]`` (PST-006).

        ``src`` and ``dst`` are 1-D integer tensors of equal length; the ``dst`` pages are
        distinct and none is a ``src`` page. This is how a fork's partial page becomes the new
        sequence's own (KVM-037): the KVManager names the copy, the store makes it. They may
        lie on the host (the plan's host copy, which the runner gives, PST-055) or on the
        store's device."""
        ...

    def prepare(self, batch: AttentionBatch) -> AttentionMetadata:
        """Check ``batch`` once (offsets, context lengths, pages and slots against the pool,
        raising :class:`~pagedkv.errors.InvalidRequest`) and lay out its attention: the
        immutable metadata every layer of the step passes to :meth:`attention`."""
        ...

    def attention(
        self,
        layer: int,
        query: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, num_heads, head_dim]`` over paged K/V, for the
        batch ``metadata`` was prepared from.

        Sequence ``b`` owns query rows ``query_start[b]:query_start[b+1]``; they are its last
        positions, so its row ``j`` sees context positions ``0..context_len - q_len + j``.
        Returns ``[T, num_heads, head_dim]``.
        """
        ...


@runtime_checkable
class Backend(Protocol):
    """A bundle of implementations under test, named by ``module:factory``.

    ``capabilities`` is a subset of :data:`CAPABILITIES`; tests needing a capability the
    backend does not declare are skipped with that reason.
    """

    @property
    def name(self) -> str:
        """Human-readable name shown in the test report header."""
        ...

    @property
    def capabilities(self) -> frozenset[str]:
        """Declared capabilities."""
        ...

    def create_kv_manager(self, config: KVManagerConfig) -> KVManager:
        """A fresh KVManager with an empty pool."""
        ...


@runtime_checkable
class StepRunner(Protocol):
    """Runs one :class:`~pagedkv.plan.StepPlan` on a model (and its PagedStore)."""

    @property
    def device(self) -> torch.device:
        """Where plans' tensors must live."""
        ...

    @property
    def vocab_size(self) -> int:
        """Rows of the logits."""
        ...

    @property
    def max_positions(self) -> int | None:
        """Positions the model was trained for (``max_position_embeddings``), ``None`` if it
        has no such limit. An engine never lets a sequence go past it (ENG-034)."""
        ...

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """``[B, vocab]`` float32 logits at ``plan.logits_indices``, on :attr:`device`; the
        engine samples them there and reads back only the batch's results (ENG-216). They
        are read before the next call, so a runner may return a buffer it reuses (a static
        decode step's output)."""
        ...


@runtime_checkable
class Closable(Protocol):
    """A runner (or anything) holding resources beyond memory, released by :meth:`close`:
    a tensor-parallel runner's worker processes (TP-023)."""

    def close(self) -> None:
        """Release them; idempotent."""
        ...


@runtime_checkable
class Engine(Protocol):
    """Orchestration: decides what runs each step and hands the model an explicit plan.

    Everything its users (the server, the command line, the benchmarks) need is here, so none
    of them depends on an implementation. Requirements ENG-001.. in ``specs/engine.md``.
    """

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, ``None`` when it has none (then prompts are token ids)."""
        ...

    @property
    def max_model_len(self) -> int:
        """Most positions one sequence may reach, prompt included (ENG-033, ENG-034)."""
        ...

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's sampling defaults, which a request without its own values takes
        (ENG-080)."""
        ...

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; returns its id. ``priority`` orders it under the ``priority``
        scheduling policy; elsewhere a value other than 0 is refused (ENG-189)."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; the outputs of the requests it advanced (a request asked
        ``final_only`` only once it has ended, ENG-157)."""
        ...

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now, freeing its pages; its final output, or ``None`` if unknown."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        ...

    def stream(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Generator[RequestOutput, None, None]:
        """Add a request and yield its outputs until it finishes."""
        ...

    def stats(self) -> EngineStats:
        """Engine-wide counters."""
        ...

    def add_step_observer(self, observer: Callable[[StepReport], None]) -> None:
        """Call ``observer`` after every step that ran, with what it did and what it took
        (ENG-051)."""
        ...

    def remove_step_observer(self, observer: Callable[[StepReport], None]) -> None:
        """Stop calling ``observer``."""
        ...

    def check_invariants(self) -> None:
        """Raise :class:`~pagedkv.errors.InvariantViolation` if the engine's bookkeeping or its
        KVManager's is inconsistent."""
        ...


@runtime_checkable
class EngineBackend(Backend, Protocol):
    """A backend declaring the ``engine`` capability also builds engines."""

    def create_engine(
        self,
        runner: StepRunner,
        config: EngineConfig,
        *,
        tokenizer: Tokenizer | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> Engine:
        """An engine over ``runner``, with a fresh page pool shaped by ``config``."""
        ...


@runtime_checkable
class SuppliedKVEngineBackend(EngineBackend, Protocol):
    """A backend declaring ``supplied_kv_manager`` builds engines over a KVManager its caller
    made with the backend's own ``create_kv_manager`` (ENG-175), so a caller can observe the
    engine's calls to its manager (ENG-027) by wrapping it."""

    def create_engine(
        self,
        runner: StepRunner,
        config: EngineConfig,
        *,
        tokenizer: Tokenizer | None = None,
        eos_ids: frozenset[int] = frozenset(),
        kv_manager: KVManager | None = None,
    ) -> Engine:
        """An engine over ``runner``; its pages on ``kv_manager`` (a pool shaped by
        ``config``), else on a fresh pool of its own."""
        ...


@runtime_checkable
class ModelBackend(Backend, Protocol):
    """A backend declaring the ``model`` capability runs Qwen3 checkpoints (golden tests)."""

    def create_model_runner(
        self,
        model_dir: str,
        *,
        num_pages: int | None,
        page_size: int,
        dtype: str = "float32",
        device: str = DEFAULT_DEVICE,
    ) -> StepRunner:
        """A runner for the checkpoint in ``model_dir``; with ``num_pages`` set it owns a paged
        K/V pool of that many pages, else it can only run cache-less (v0) plans."""
        ...


@runtime_checkable
class PagedStoreBackend(Backend, Protocol):
    """A backend declaring the ``paged_store`` capability builds PagedStores."""

    def create_paged_store(self, config: StoreConfig) -> PagedStore:
        """A store whose pool is preallocated once, shaped by ``config``."""
        ...
