"""Deliberately broken backends, one bug each, to prove the conformance suite can fail.

Every room has its set: KVManagers (:mod:`mutants.kv`), PagedStores (:mod:`mutants.store`),
engines and samplers (:mod:`mutants.engine`). :data:`MUTANTS` names each one, the room it
breaks, the classes of issue 14 it stands for (1 continuing chunks through real attention,
2 page tables out of order, 3 stale data in the pool, 4 text, 5 order after preemption,
6 sampling filters from below, 7 ENG-034 / KVM-003 / KVM-028, 8 variants) and the suite
modules that must fail on it. ``tests/test_mutants.py`` runs those modules against each
(``--backend mutants:<name>``, with ``tests/`` on ``PYTHONPATH``) and expects a failure.

:data:`CORRECT` are backends that differ from the reference where the spec leaves room and
declare it: the suite must pass them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.kv.manager import ReferenceKVManager

from . import engine as eng
from . import kv, store
from .backend import ALL_CAPABILITIES, MutantBackend
from .variants import RadixKVManager, ReattachingKVManager

KV_SUITE = (
    "pagedkv_conformance.test_kv_manager",
    "pagedkv_conformance.test_kv_match",
    "pagedkv_conformance.test_kv_state_machine",
)
VARIANT_SUITE = ("pagedkv_conformance.test_kv_variants",)
STORE_SUITE = ("pagedkv_conformance.test_paged_store",)
ENGINE_SUITE = ("pagedkv_conformance.test_engine",)
MODEL_SUITE = ("pagedkv_conformance.test_engine_model",)
TEXT_SUITE = ("pagedkv_conformance.test_engine_text",)


@dataclass(frozen=True)
class Mutant:
    """One broken backend and where the suite must catch it.

    Attributes:
        room: ``kv``, ``store``, ``engine`` or ``sampler``.
        classes: the classes of issue 14 it stands for (empty: a bug the first suite caught).
        suites: conformance modules that must fail on it.
        build: the backend factory.
        select: a ``-k`` expression naming the tests of ``suites`` that catch it, when running
            only those is much faster (the real-model cases).
    """

    room: str
    classes: tuple[int, ...]
    suites: tuple[str, ...]
    build: Callable[[], MutantBackend] = field(repr=False)
    select: str | None = None


def _kv(name: str, manager: type[ReferenceKVManager], *classes: int) -> Mutant:
    suites = KV_SUITE if not classes else ("pagedkv_conformance.test_kv_manager",)
    return Mutant("kv", classes, suites, lambda: MutantBackend(f"mutant: {name}", manager))


def _full(
    room: str,
    name: str,
    classes: tuple[int, ...],
    suites: tuple[str, ...],
    select: str | None = None,
    **part: Any,
) -> Mutant:
    return Mutant(
        room,
        classes,
        suites,
        lambda: MutantBackend(f"mutant: {name}", capabilities=ALL_CAPABILITIES, **part),
        select,
    )


#: Every mutant, by the name ``--backend mutants:<name>`` takes.
MUTANTS: dict[str, Mutant] = {
    # -- KVManager ---------------------------------------------------------------------------
    "leak_on_free": _kv("leak on free", kv.LeakOnFree),
    "free_shared_page": _kv("free a shared page", kv.FreeSharedPage),
    "publish_before_commit": _kv("publish before commit", kv.PublishBeforeCommit),
    "mru_eviction": _kv("evict the most recently used", kv.MruEviction),
    "evict_own_hits": _kv("evict the allocation's own hits", kv.EvictOwnHits),
    "parent_first_free": _kv("queue the parent before the tail", kv.ParentFirstFree),
    "salt_blind": _kv("ignore the salt", kv.SaltBlind),
    "unverified_hash": _kv("trust a weak hash", kv.UnverifiedHash),
    "partial_grow": _kv("keep pages of a failed grow", kv.PartialGrow),
    "in_flight_blind": _kv("report no page in flight", kv.InFlightBlind),
    "stale_match_taken": _kv("allocate from a stale match", kv.StaleMatchTaken),
    "empty_lookup_is_zero": _kv("empty cached_prefix_length is 0", kv.EmptyLookupIsZero, 7),
    "salt_by_identity": _kv("compare salts by identity", kv.SaltByIdentity, 7),
    "radix_declared_as_block": Mutant(
        "kv",
        (8,),
        VARIANT_SUITE,
        lambda: MutantBackend("mutant: radix index declaring orphans=block", RadixKVManager),
    ),
    "reattach_declared_as_detach": Mutant(
        "kv",
        (8,),
        VARIANT_SUITE + ("pagedkv_conformance.test_kv_state_machine",),
        lambda: MutantBackend(
            "mutant: reattaching index declaring orphans=detach",
            ReattachingKVManager,
            variants={"orphans": "detach"},
        ),
    ),
    # -- PagedStore --------------------------------------------------------------------------
    "store_ascending_pages": _full(
        "store",
        "pages read in ascending order",
        (2,),
        MODEL_SUITE,
        "recycled_pages",
        store=store.AscendingPages,
    ),
    "store_ascending_pages_direct": _full(
        "store", "pages read in ascending order", (2,), STORE_SUITE, store=store.AscendingPages
    ),
    "store_mask_only_by_softmax": _full(
        "store",
        "stale slots hidden by the softmax only",
        (3,),
        STORE_SUITE,
        store=store.MaskOnlyBySoftmax,
    ),
    "store_top_left_causal_mask": _full(
        "store",
        "top-left causal mask",
        (1,),
        MODEL_SUITE,
        "chunked_prefill",
        store=store.TopLeftCausalMask,
    ),
    "store_chunk_ignores_cached_context": _full(
        "store",
        "a chunk ignores its cached context",
        (1,),
        STORE_SUITE,
        store=store.ChunkIgnoresCachedContext,
    ),
    "store_decode_misses_newest": _full(
        "store",
        "decode misses its newest position",
        (),
        STORE_SUITE,
        store=store.DecodeMissesNewest,
    ),
    "store_write_ignores_layer": _full(
        "store", "every layer written to layer 0", (), STORE_SUITE, store=store.WriteIgnoresLayer
    ),
    # -- Engine ------------------------------------------------------------------------------
    "engine_chunk_positions_restart": _full(
        "engine",
        "continuing chunks get positions from 0",
        (1,),
        MODEL_SUITE,
        "chunked_prefill",
        runner=eng.ChunkPositionsRestart,
    ),
    "engine_chunk_positions_restart_hash": _full(
        "engine",
        "continuing chunks get positions from 0",
        (1,),
        ENGINE_SUITE,
        runner=eng.ChunkPositionsRestart,
    ),
    "engine_no_position_limit": _full(
        "engine",
        "the model's trained positions ignored",
        (7,),
        MODEL_SUITE,
        "trained_positions",
        runner=eng.NoPositionLimit,
    ),
    "engine_stop_strings_ignored": _full(
        "engine",
        "stop strings ignored",
        (4,),
        TEXT_SUITE,
        "stop_strings_end",
        engine=eng.StopStringsIgnored,
    ),
    "engine_new_text_is_whole_text": _full(
        "engine",
        "new_text repeats the whole text",
        (4,),
        TEXT_SUITE,
        "stream_adds_up",
        engine=eng.NewTextIsWholeText,
    ),
    "engine_preempted_queue_last": _full(
        "engine",
        "preempted requests queue behind later arrivals",
        (5,),
        ENGINE_SUITE,
        adjust=eng.preempted_requests_queue_last,
    ),
    # -- sampler -----------------------------------------------------------------------------
    "sampler_top_k_keeps_one_less": _full(
        "sampler", "top-k keeps k-1", (6,), ENGINE_SUITE, adjust=eng.top_k_keeps_one_less
    ),
    "sampler_top_p_stops_short": _full(
        "sampler",
        "top-p stops short of the mass",
        (6,),
        ENGINE_SUITE,
        adjust=eng.top_p_stops_short,
    ),
    "sampler_top_k_keeps_one_more": _full(
        "sampler", "top-k keeps k+1", (), ENGINE_SUITE, adjust=eng.top_k_keeps_one_more
    ),
}

#: Correct backends that differ from the reference where the spec leaves room, declaring it.
CORRECT: dict[str, Callable[[], MutantBackend]] = {
    "radix_declared_as_detach": lambda: MutantBackend(
        "radix index declaring orphans=detach", RadixKVManager, variants={"orphans": "detach"}
    ),
    "reattach_declared": lambda: MutantBackend(
        "reattaching index declaring orphans=reattach",
        ReattachingKVManager,
        variants={"orphans": "reattach"},
    ),
}

# ``--backend mutants:<name>`` imports this module and calls ``<name>()``.
globals().update({name: m.build for name, m in MUTANTS.items()})
globals().update(CORRECT)


# -- backends that are not what they claim, for the plugin's own checks --------------------


def not_a_backend() -> object:
    """A factory whose result lacks the Backend attributes: a usage error."""
    return object()


def no_capabilities() -> MutantBackend:
    """The reference KVManager declaring no capability: every ``requires`` test is skipped."""
    return MutantBackend("reference without capabilities", ReferenceKVManager, frozenset())


def unknown_variant() -> MutantBackend:
    """A backend declaring a choice no variant has: a usage error."""
    return MutantBackend("unknown variant choice", variants={"orphans": "sometimes"})
