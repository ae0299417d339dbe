"""vLLM's v1 KV cache manager behind pagedkv's :class:`~pagedkv.interfaces.KVManager` Protocol.

What is vLLM's and what is the adapter's:

* Pages, reference counts, the prefix cache, hits, publication and eviction are all vLLM's:
  every call goes to one ``vllm.v1.core.kv_cache_manager.KVCacheManager`` (over its
  ``BlockPool``), configured as vLLM's scheduler configures it for a model whose layers all use
  full attention (one KV cache group, ``hash_block_size == block_size``, SHA-256 block hashes).
  The adapter never corrects what vLLM does, so the conformance suite sees vLLM's behaviour.
* The adapter plays the part of vLLM's scheduler: it owns the ``Request`` objects, so sequence
  ids, double frees and argument ranges (KVM-003, KVM-013, KVM-014) are its checks. In vLLM
  those live in the input processor and the scheduler, not in the KV cache manager.

The mapping, call by call (``page = block_id - 1``: vLLM keeps block 0 as its null block, a
placeholder it never hands out, so a pool of ``num_pages`` pages is ``num_pages + 1`` blocks):

============================  ===================================================================
pagedkv                       vLLM
============================  ===================================================================
``allocate``                  ``Request(prompt, cache_salt)``, ``get_computed_blocks``, then
                              ``allocate_slots(num_new_tokens, hits)``; ``None`` → OutOfPages;
                              ``record_prefix_cache_stats`` on success (as the scheduler does)
``grow``                      ``allocate_slots`` for the positions past the reservation
``commit``                    output tokens appended to the ``Request``, then ``cache_blocks``
``free``                      ``free(request)`` (tail block first)
``page_table``                ``get_block_ids(request_id)``
``ref_count``                 ``block_pool.blocks[page + 1].ref_cnt``
``cached_prefix_length``      ``get_computed_blocks`` on a throwaway ``Request`` (a pure lookup)
``match_prefix``              the same lookup, its hit blocks kept in the match; nothing in
                              flight (vLLM tracks no uncommitted prefix: see below)
``allocate(match=...)``       ``allocate_slots(num_new_tokens, hits)`` with the match's hit
                              blocks, as vLLM's scheduler passes the blocks it just looked up
``stats``                     block states read off the ``BlockPool``; query and hit tokens from
                              vLLM's ``PrefixCacheStats``; evictions counted from vLLM's
                              ``BlockRemoved`` KV cache events
``reset_prefix_cache``        ``reset_prefix_cache()``; ``False`` → PagesInUse
``enable_prefix_caching``     ``KVCacheManager(enable_caching=...)``
cache salt                    ``Request(cache_salt=...)``: vLLM's extra hash key of block 0
============================  ===================================================================

When a block is published depends on :class:`Publish`: vLLM's ``allocate_slots`` caches the
full blocks of the tokens it *schedules* unless the caller passes ``delay_cache_blocks=True``
and calls ``cache_blocks`` later, which is what vLLM's scheduler does for KV that a connector
loads asynchronously.

A prefix match (KVM-033..036) is vLLM's scheduler pattern made explicit: the scheduler calls
``get_computed_blocks`` and hands the blocks it found to ``allocate_slots`` in the same
scheduling pass, with nothing in between. The adapter keeps the found blocks in the
:class:`~pagedkv.interfaces.PrefixMatch` and, playing the scheduler, refuses a match once any
call has changed the manager (``StaleMatch``), as pagedkv's Protocol asks. vLLM has no notion
of pages *in flight*: a block being computed by a live request is either already published
(blocks published when scheduled) or invisible to every lookup until ``cache_blocks`` (published
on commit), so a match reports no in-flight tokens; the backends declare it (variant
``in-flight=untracked``).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_events import BlockRemoved
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from pagedkv.errors import (
    DoubleFree,
    DuplicateSequence,
    InvalidRequest,
    InvariantViolation,
    OutOfPages,
    PagesInUse,
    StaleMatch,
    UnknownSequence,
)
from pagedkv.interfaces import Allocation, KVManagerConfig, KVStats, PageTable, PrefixMatch

#: vLLM's block 0 is its null block: page ``p`` is block ``p + NULL_BLOCKS``.
NULL_BLOCKS = 1
#: Context limit handed to vLLM: far above any pool the suite builds, so vLLM never truncates
#: a reservation (it caps slots at ``max_model_len``).
MAX_MODEL_LEN = 1 << 40
#: ``max_tokens`` of the requests' sampling parameters; vLLM's KV cache manager never reads it.
MAX_TOKENS = 1 << 20


class Publish(enum.Enum):
    """When the adapter lets vLLM publish a full block to its prefix cache."""

    #: As vLLM's scheduler does for tokens it computes itself: ``allocate_slots`` caches the
    #: full blocks of the tokens it has just scheduled, before the step writes their K/V.
    ON_SCHEDULE = "schedule"
    #: As vLLM's scheduler does for KV loaded asynchronously: ``allocate_slots`` runs with
    #: ``delay_cache_blocks=True`` and pagedkv's ``commit`` calls ``cache_blocks``.
    ON_COMMIT = "commit"


@dataclass(slots=True)
class _Sequence:
    """A live sequence: vLLM's request and the positions reserved for it."""

    request: Any  # vllm.v1.request.Request
    num_tokens: int


@dataclass(frozen=True, slots=True)
class _MatchState:
    """The opaque ``state`` of a match this adapter issued: the manager's state token when it
    was taken, and the hit blocks vLLM's lookup returned (a ``KVCacheBlocks``)."""

    epoch: object
    hits: Any
    num_hit_tokens: int


def _pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class VLLMKVManager:
    """A pagedkv KVManager whose every page decision is made by vLLM's ``KVCacheManager``."""

    def __init__(
        self,
        config: KVManagerConfig,
        publish: Publish = Publish.ON_SCHEDULE,
        hash_fn: Callable[[Any], bytes] = sha256,
    ) -> None:
        """A manager over a fresh vLLM ``KVCacheManager``.

        Args:
            config: the pool's shape and whether prefix caching is on.
            publish: when vLLM publishes a full block (see :class:`Publish`).
            hash_fn: vLLM's block hash function; SHA-256 is vLLM's default
                (``--prefix-caching-hash-algo sha256``). Only the variant tests pass another.
        """
        self._config = config
        self._publish = publish
        # vLLM's chained hashes start from a process-wide seed derived from the hash function
        # (a fixed one for SHA-256), so setting it again for each manager is harmless.
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(config.page_size, hash_fn)
        spec = FullAttentionSpec(
            block_size=config.page_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=config.num_pages + NULL_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)],
        )
        self._vllm = KVCacheManager(
            kv_cache_config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=config.page_size,
            hash_block_size=config.page_size,
            enable_caching=config.enable_prefix_caching,
            log_stats=True,
            enable_kv_cache_events=True,
        )
        self._pool = self._vllm.block_pool
        self._live: dict[int, _Sequence] = {}
        self._freed: set[int] = set()
        self._request_ids = itertools.count()
        self._evictions = 0
        #: Replaced by every successful state-changing call: older matches are stale.
        self._epoch = object()

    # -- the Protocol's read-only part -----------------------------------------------------

    @property
    def page_size(self) -> int:
        return self._config.page_size

    @property
    def num_pages(self) -> int:
        return self._config.num_pages

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        if not token_ids:
            raise InvalidRequest("cached_prefix_length of an empty prompt")
        _, num_hit_tokens, _ = self._vllm.get_computed_blocks(
            self._new_request("lookup", token_ids, cache_salt)
        )
        return int(num_hit_tokens)

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        """vLLM's lookup (``get_computed_blocks``, pure), its hit blocks kept for ``allocate``;
        no pages in flight (vLLM tracks none)."""
        if not token_ids:
            raise InvalidRequest("match_prefix of an empty prompt")
        hits, num_hit_tokens, _ = self._vllm.get_computed_blocks(
            self._new_request("match", token_ids, cache_salt)
        )
        (block_ids,) = hits.get_block_ids()
        return PrefixMatch(
            token_ids=tuple(token_ids),
            cache_salt=cache_salt,
            hit_pages=tuple(block_id - NULL_BLOCKS for block_id in block_ids),
            num_cached_tokens=int(num_hit_tokens),
            num_in_flight_tokens=0,
            state=_MatchState(self._epoch, hits, int(num_hit_tokens)),
        )

    def page_table(self, seq_id: int) -> PageTable:
        seq = self._sequence(seq_id)
        (block_ids,) = self._vllm.get_block_ids(seq.request.request_id)
        pages = tuple(block_id - NULL_BLOCKS for block_id in block_ids)
        return PageTable(seq_id, self.page_size, pages, seq.num_tokens)

    def ref_count(self, page: int) -> int:
        self._check_page(page)
        return int(self._pool.blocks[page + NULL_BLOCKS].ref_cnt)

    def stats(self) -> KVStats:
        self._count_evictions()
        blocks = self._pool.blocks[NULL_BLOCKS:]
        queued = self._pool.free_block_queue.get_all_free_blocks()
        cached = sum(1 for block in queued if block.block_hash is not None)
        prefix = self._vllm.prefix_cache_stats
        return KVStats(
            num_pages=self.num_pages,
            pages_in_use=sum(1 for block in blocks if block.ref_cnt > 0),
            pages_free=len(queued) - cached,
            pages_cached=cached,
            pages_indexed=sum(1 for block in blocks if block.block_hash is not None),
            query_tokens=prefix.queries + prefix.preempted_queries,
            hit_tokens=prefix.hits + prefix.preempted_hits,
            evictions=self._evictions,
        )

    # -- calls that move pages -------------------------------------------------------------

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        *,
        match: PrefixMatch | None = None,
    ) -> Allocation:
        if seq_id in self._live:
            raise DuplicateSequence(seq_id)
        if not token_ids:
            raise InvalidRequest("allocate of an empty prompt")
        if num_new_tokens < 1:
            raise InvalidRequest(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        request = self._new_request(f"seq-{seq_id}", token_ids, cache_salt)
        if match is None:
            hits, num_hit_tokens, _ = self._vllm.get_computed_blocks(request)
        else:
            hits, num_hit_tokens = self._matched(match, token_ids, cache_salt)
        new_blocks = self._vllm.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens=num_hit_tokens,
            new_computed_blocks=hits,
            delay_cache_blocks=self._publish is Publish.ON_COMMIT,
        )
        if new_blocks is None:
            self._count_evictions()
            needed = _pages_for(num_hit_tokens + num_new_tokens, self.page_size)
            raise OutOfPages(needed, self._pool.get_num_free_blocks())
        self._vllm.record_prefix_cache_stats(request, num_hit_tokens)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens + num_new_tokens
        self._live[seq_id] = _Sequence(request, num_hit_tokens + num_new_tokens)
        self._freed.discard(seq_id)
        self._count_evictions()
        self._epoch = object()
        (fresh,) = new_blocks.get_block_ids()
        return Allocation(self.page_table(seq_id), int(num_hit_tokens), len(fresh))

    def grow(self, seq_id: int, num_tokens: int) -> PageTable:
        seq = self._sequence(seq_id)
        if num_tokens < seq.num_tokens:
            raise InvalidRequest(
                f"grow of sequence {seq_id} to {num_tokens} tokens, below its {seq.num_tokens}"
            )
        if num_tokens > seq.num_tokens:
            # vLLM's scheduler counts scheduled tokens as computed before the next
            # allocate_slots; the reservation plays that part here.
            seq.request.num_computed_tokens = seq.num_tokens
            new_blocks = self._vllm.allocate_slots(
                seq.request,
                num_tokens - seq.num_tokens,
                delay_cache_blocks=self._publish is Publish.ON_COMMIT,
            )
            self._count_evictions()
            if new_blocks is None:
                needed = _pages_for(num_tokens, self.page_size) - len(self.page_table(seq_id).pages)
                raise OutOfPages(needed, self._pool.get_num_free_blocks())
            seq.num_tokens = num_tokens
            seq.request.num_computed_tokens = num_tokens
        self._epoch = object()
        return self.page_table(seq_id)

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> int:
        seq = self._sequence(seq_id)
        if len(token_ids) > seq.num_tokens:
            raise InvalidRequest(
                f"commit of {len(token_ids)} tokens past the {seq.num_tokens} reserved for "
                f"sequence {seq_id}"
            )
        known = list(seq.request.all_token_ids)
        common = min(len(known), len(token_ids))
        if list(token_ids[:common]) != known[:common]:
            raise InvalidRequest(
                f"commit's tokens for sequence {seq_id} differ from the ones it holds: a vLLM "
                "request's tokens only ever grow"
            )
        if len(token_ids) > len(known):
            seq.request.append_output_token_ids(list(token_ids[len(known) :]))
        before = self._num_published(seq)
        self._vllm.cache_blocks(seq.request, len(token_ids))
        self._count_evictions()
        self._epoch = object()
        return self._num_published(seq) - before

    def free(self, seq_id: int) -> None:
        if seq_id not in self._live and seq_id in self._freed:
            raise DoubleFree(seq_id)
        seq = self._sequence(seq_id)
        self._vllm.free(seq.request)
        del self._live[seq_id]
        self._freed.add(seq_id)
        self._count_evictions()
        self._epoch = object()

    def reset_prefix_cache(self) -> None:
        if not self._vllm.reset_prefix_cache():
            raise PagesInUse(self.stats().pages_in_use)
        self._count_evictions()
        self._epoch = object()

    # -- checks ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Check vLLM's block pool against itself and against the live requests."""
        pool = self._pool
        queued = pool.free_block_queue.get_all_free_blocks()
        queued_ids = [block.block_id for block in queued]
        problems: list[str] = []
        if len(set(queued_ids)) != len(queued_ids):
            problems.append(f"a block is queued twice: {queued_ids}")
        if len(queued) != pool.free_block_queue.num_free_blocks:
            problems.append(
                f"{len(queued)} blocks queued but num_free_blocks is "
                f"{pool.free_block_queue.num_free_blocks}"
            )
        holders = [0] * len(pool.blocks)
        for seq_id, seq in self._live.items():
            (block_ids,) = self._vllm.get_block_ids(seq.request.request_id)
            if len(block_ids) != _pages_for(seq.num_tokens, self.page_size):
                problems.append(f"sequence {seq_id}: {len(block_ids)} blocks for {seq.num_tokens}")
            for block_id in block_ids:
                holders[block_id] += 1
        queued_set = set(queued_ids)
        for block in pool.blocks[NULL_BLOCKS:]:
            in_queue = block.block_id in queued_set
            if block.ref_cnt != holders[block.block_id]:
                problems.append(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                    f"{holders[block.block_id]} holders"
                )
            if in_queue == (block.ref_cnt > 0):
                problems.append(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, queued {in_queue}"
                )
            if block.block_hash is not None and not pool.cached_block_hash_to_block.contain(
                block.block_hash, block.block_id
            ):
                problems.append(f"block {block.block_id} has a hash the cache does not map to it")
        if problems:
            raise InvariantViolation("; ".join(problems))

    # -- plumbing --------------------------------------------------------------------------

    def _sequence(self, seq_id: int) -> _Sequence:
        seq = self._live.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id)
        return seq

    def _matched(
        self, match: PrefixMatch, token_ids: Sequence[int], cache_salt: str | None
    ) -> tuple[Any, int]:
        """The hit blocks of ``match``, if this manager issued it for this prompt and salt and
        nothing changed since; else :class:`~pagedkv.errors.StaleMatch`."""
        state = match.state
        if not isinstance(state, _MatchState) or state.epoch is not self._epoch:
            raise StaleMatch("the prefix match was taken by another manager, or before a change")
        if match.cache_salt != cache_salt or match.token_ids != tuple(token_ids):
            raise StaleMatch("the prefix match is of another prompt or salt")
        return state.hits, state.num_hit_tokens

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise InvalidRequest(f"page {page} outside the pool of {self.num_pages}")

    def _new_request(self, name: str, token_ids: Sequence[int], cache_salt: str | None) -> Any:
        return Request(
            request_id=f"{name}-{next(self._request_ids)}",
            prompt_token_ids=list(token_ids),
            sampling_params=SamplingParams(max_tokens=MAX_TOKENS),
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=self._block_hasher,
        )

    def _num_published(self, seq: _Sequence) -> int:
        (blocks,) = self._vllm.get_blocks(seq.request.request_id).blocks
        return sum(1 for block in blocks if block.block_hash is not None)

    def _count_evictions(self) -> None:
        """Drain vLLM's KV cache events; every ``BlockRemoved`` is one evicted block."""
        for event in self._vllm.take_events():
            if isinstance(event, BlockRemoved):
                self._evictions += len(event.block_hashes)
