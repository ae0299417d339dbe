"""Deliberately broken backends, one bug each, to prove the conformance suite can fail.

Every room has its set: KVManagers (:mod:`mutants.kv`), PagedStores (:mod:`mutants.store`),
engines and samplers (:mod:`mutants.engine`). :data:`MUTANTS` names each one, the room it
breaks, the classes of issue 14 it stands for (1 continuing chunks through real attention,
2 page tables out of order, 3 stale data in the pool, 4 text, 5 order after preemption,
6 sampling filters from below, 7 ENG-034 / KVM-003 / KVM-028, 8 variants) and the suite
tests that must fail on it. ``tests/test_mutants.py`` runs those tests against each
(``--backend mutants:<name>``, with ``tests/`` on the path) and expects each to fail.

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
from .backend import ALL_CAPABILITIES, KV_CAPABILITIES, MutantBackend
from .variants import (
    EmptySaltIsNoSaltKVManager,
    OneQueueKVManager,
    QueriesCountedOnLookupKVManager,
    RadixKVManager,
    ReattachingKVManager,
    ReplacingKVManager,
    UntrackedInFlightKVManager,
)

#: Node ids, relative to the ``pagedkv_conformance`` package, of the tests that catch mutants.
KVM = "test_kv_manager::TestKVManager::"
MATCH = "test_kv_match::TestKVMatch::"
VARIANTS = "test_kv_variants::TestKVVariants::"
STATE_MACHINE = "test_kv_state_machine::TestKVStateMachine::test_kv_manager_matches_the_oracle"
STORE = "test_paged_store::TestPagedStore::"
ENGINE = "test_engine::TestEngine::"
MODEL = "test_engine_model::TestEngineModel::"
TEXT = "test_engine_text::TestEngineText::"


@dataclass(frozen=True)
class Mutant:
    """One broken backend and the suite's tests that catch it.

    Attributes:
        room: ``kv``, ``store``, ``engine`` or ``sampler``.
        classes: the classes of issue 14 it stands for (empty: a bug the first suite caught).
        catches: tests of the conformance suite (node ids under ``pagedkv_conformance``) that
            must each fail on it, and pass on the reference.
        build: the backend factory.
    """

    room: str
    classes: tuple[int, ...]
    catches: tuple[str, ...]
    build: Callable[[], MutantBackend] = field(repr=False)


def _kv(
    name: str, manager: type[ReferenceKVManager], catches: tuple[str, ...], *classes: int
) -> Mutant:
    return Mutant("kv", classes, catches, lambda: MutantBackend(f"mutant: {name}", manager))


def _full(
    room: str, name: str, classes: tuple[int, ...], catches: tuple[str, ...], **part: Any
) -> Mutant:
    return Mutant(
        room,
        classes,
        catches,
        lambda: MutantBackend(f"mutant: {name}", capabilities=ALL_CAPABILITIES, **part),
    )


#: Every mutant, by the name ``--backend mutants:<name>`` takes.
MUTANTS: dict[str, Mutant] = {
    # -- KVManager ---------------------------------------------------------------------------
    "leak_on_free": _kv(
        "leak on free", kv.LeakOnFree, (KVM + "test_free_returns_every_page_exactly_once[caching]",)
    ),
    "free_shared_page": _kv(
        "free a shared page",
        kv.FreeSharedPage,
        (KVM + "test_ref_counts_equal_holders_of_shared_pages",),
    ),
    "publish_before_commit": _kv(
        "publish before commit",
        kv.PublishBeforeCommit,
        (KVM + "test_nothing_is_hit_before_commit",),
    ),
    "mru_eviction": _kv(
        "evict the most recently used",
        kv.MruEviction,
        (KVM + "test_eviction_is_lru_tail_first_and_only_when_free_list_is_empty",),
    ),
    "evict_own_hits": _kv(
        "evict the allocation's own hits",
        kv.EvictOwnHits,
        (KVM + "test_hit_pages_are_not_evicted_for_the_same_allocation",),
    ),
    "parent_first_free": _kv(
        "queue the parent before the tail",
        kv.ParentFirstFree,
        (KVM + "test_eviction_is_lru_tail_first_and_only_when_free_list_is_empty",),
    ),
    "salt_blind": _kv(
        "ignore the salt", kv.SaltBlind, (KVM + "test_salts_isolate_and_equal_salts_share",)
    ),
    "unverified_hash": _kv(
        "trust a weak hash", kv.UnverifiedHash, (KVM + "test_lookalike_prompts_never_share_pages",)
    ),
    "partial_grow": _kv(
        "keep pages of a failed grow",
        kv.PartialGrow,
        (KVM + "test_grow_out_of_pages_changes_nothing[caching]",),
    ),
    "in_flight_blind": _kv(
        "report no page in flight",
        kv.InFlightBlind,
        (MATCH + "test_uncommitted_pages_are_in_flight_never_hit",),
    ),
    "stale_match_taken": _kv(
        "allocate from a stale match",
        kv.StaleMatchTaken,
        (MATCH + "test_a_match_is_stale_after_a_reset",),
    ),
    "empty_lookup_is_zero": _kv(
        "empty cached_prefix_length is 0",
        kv.EmptyLookupIsZero,
        (KVM + "test_out_of_range_arguments_raise_invalid_request[empty-lookup]",),
        7,
    ),
    "salt_by_identity": _kv(
        "compare salts by identity",
        kv.SaltByIdentity,
        (KVM + "test_equal_salts_built_at_run_time_share",),
        7,
    ),
    "radix_declared_as_block": Mutant(
        "kv",
        (8,),
        (VARIANTS + "test_orphaned_entries_follow_the_declared_variant",),
        lambda: MutantBackend("mutant: radix index declaring orphans=block", RadixKVManager),
    ),
    "reattach_declared_as_detach": Mutant(
        "kv",
        (8,),
        (VARIANTS + "test_orphaned_entries_follow_the_declared_variant",),
        lambda: MutantBackend(
            "mutant: reattaching index declaring orphans=detach",
            ReattachingKVManager,
            variants={"orphans": "detach"},
        ),
    ),
    "in_flight_untracked_undeclared": Mutant(
        "kv",
        (8,),
        (
            MATCH + "test_uncommitted_pages_are_in_flight_never_hit",
            MATCH + "test_a_partly_committed_shared_prompt_stays_consistent",
        ),
        lambda: MutantBackend(
            "mutant: no pages in flight, declared tracked", UntrackedInFlightKVManager
        ),
    ),
    "in_flight_tracked_declared_untracked": Mutant(
        "kv",
        (8,),
        (MATCH + "test_a_partly_committed_shared_prompt_stays_consistent",),
        lambda: MutantBackend(
            "mutant: the reference declaring in-flight=untracked",
            variants={"in-flight": "untracked"},
        ),
    ),
    "one_queue_undeclared": Mutant(
        "kv",
        (8,),
        (KVM + "test_eviction_is_lru_tail_first_and_only_when_free_list_is_empty",),
        lambda: MutantBackend("mutant: one queue of pages, declared free-first", OneQueueKVManager),
    ),
    "free_first_declared_one_queue": Mutant(
        "kv",
        (8,),
        (KVM + "test_eviction_is_lru_tail_first_and_only_when_free_list_is_empty",),
        lambda: MutantBackend(
            "mutant: the reference declaring eviction=one-queue",
            variants={"eviction": "one-queue"},
        ),
    ),
    "replaced_undeclared": Mutant(
        "kv",
        (8,),
        (VARIANTS + "test_duplicate_publication_follows_the_declared_variant",),
        lambda: MutantBackend(
            "mutant: commits take entries over, declared kept-once", ReplacingKVManager
        ),
    ),
    "kept_once_declared_replaced": Mutant(
        "kv",
        (8,),
        (VARIANTS + "test_duplicate_publication_follows_the_declared_variant",),
        lambda: MutantBackend(
            "mutant: the reference declaring duplicates=replaced",
            variants={"duplicates": "replaced"},
        ),
    ),
    # -- PagedStore --------------------------------------------------------------------------
    "store_ascending_pages": _full(
        "store",
        "pages read in ascending order",
        (2,),
        (
            MODEL + "test_recycled_pages_out_of_order_match_transformers",
            STORE + "test_same_sequence_on_permuted_pages_attends_the_same",
            STORE + "test_recycled_pages_hold_only_the_new_owner",
        ),
        store=store.AscendingPages,
    ),
    "store_mask_only_by_softmax": _full(
        "store",
        "stale slots hidden by the softmax only",
        (3,),
        (STORE + "test_nan_and_inf_outside_every_context_never_leak",),
        store=store.MaskOnlyBySoftmax,
    ),
    "store_top_left_causal_mask": _full(
        "store",
        "top-left causal mask",
        (1,),
        (
            MODEL + "test_chunked_prefill_matches_transformers",
            STORE + "test_causal_mask_of_a_continuing_chunk_is_exact",
        ),
        store=store.TopLeftCausalMask,
    ),
    "store_chunk_ignores_cached_context": _full(
        "store",
        "a chunk ignores its cached context",
        (1,),
        (STORE + "test_causal_mask_of_a_continuing_chunk_is_exact",),
        store=store.ChunkIgnoresCachedContext,
    ),
    "store_decode_misses_newest": _full(
        "store",
        "decode misses its newest position",
        (),
        (STORE + "test_ragged_batch_on_shuffled_pages_matches_the_dense_reference[1]",),
        store=store.DecodeMissesNewest,
    ),
    "store_write_ignores_layer": _full(
        "store",
        "every layer written to layer 0",
        (),
        (STORE + "test_read_returns_exactly_the_last_write",),
        store=store.WriteIgnoresLayer,
    ),
    # -- Engine ------------------------------------------------------------------------------
    "engine_chunk_positions_restart": _full(
        "engine",
        "continuing chunks get positions from 0",
        (1,),
        (
            MODEL + "test_chunked_prefill_matches_transformers",
            MODEL + "test_suffix_after_a_prefix_hit_matches_transformers",
            ENGINE + "test_shared_three_page_prefix_computes_only_the_suffix",
        ),
        runner=eng.ChunkPositionsRestart,
    ),
    "engine_no_position_limit": _full(
        "engine",
        "the model's trained positions ignored",
        (7,),
        (MODEL + "test_sequences_never_pass_the_models_trained_positions",),
        runner=eng.NoPositionLimit,
    ),
    "engine_stop_strings_ignored": _full(
        "engine",
        "stop strings ignored",
        (4,),
        (TEXT + "test_stop_strings_end_generation_and_are_trimmed",),
        engine=eng.StopStringsIgnored,
    ),
    "engine_new_text_is_whole_text": _full(
        "engine",
        "new_text repeats the whole text",
        (4,),
        (TEXT + "test_a_stream_adds_up_to_the_text",),
        engine=eng.NewTextIsWholeText,
    ),
    "engine_output_kind_ignored": _full(
        "engine",
        "output_kind ignored",
        (),
        (TEXT + "test_final_only_returns_the_finished_output_alone",),
        engine=eng.OutputKindIgnored,
    ),
    "engine_preempted_queue_last": _full(
        "engine",
        "preempted requests queue behind later arrivals",
        (5,),
        (ENGINE + "test_a_preempted_request_keeps_its_place_in_line",),
        adjust=eng.preempted_requests_queue_last,
    ),
    # -- sampler -----------------------------------------------------------------------------
    "sampler_top_k_keeps_one_less": _full(
        "sampler",
        "top-k keeps k-1",
        (6,),
        (ENGINE + "test_sampling_draws_exactly_what_the_filters_keep[top_k=3]",),
        adjust=eng.top_k_keeps_one_less,
    ),
    "sampler_top_p_stops_short": _full(
        "sampler",
        "top-p stops short of the mass",
        (6,),
        (ENGINE + "test_sampling_draws_exactly_what_the_filters_keep[top_p=0.6]",),
        adjust=eng.top_p_stops_short,
    ),
    "sampler_top_k_keeps_one_more": _full(
        "sampler",
        "top-k keeps k+1",
        (),
        (ENGINE + "test_sampling_draws_exactly_what_the_filters_keep[top_k=3]",),
        adjust=eng.top_k_keeps_one_more,
    ),
}

#: Correct backends that differ from the reference where the spec leaves room, declaring it.
CORRECT: dict[str, Callable[[], MutantBackend]] = {
    "radix_declared_as_detach": lambda: MutantBackend(
        "radix index declaring orphans=detach",
        RadixKVManager,
        KV_CAPABILITIES | {"fork"},
        variants={"orphans": "detach"},
    ),
    "reattach_declared": lambda: MutantBackend(
        "reattaching index declaring orphans=reattach",
        ReattachingKVManager,
        KV_CAPABILITIES | {"fork"},
        variants={"orphans": "reattach"},
    ),
    "in_flight_untracked_declared": lambda: MutantBackend(
        "the reference tracking nothing in flight, declaring in-flight=untracked",
        UntrackedInFlightKVManager,
        KV_CAPABILITIES | {"fork"},
        variants={"in-flight": "untracked"},
    ),
    "one_queue_declared": lambda: MutantBackend(
        "the reference over one queue of cached and free pages, declaring eviction=one-queue",
        OneQueueKVManager,
        KV_CAPABILITIES | {"fork"},
        variants={"eviction": "one-queue"},
    ),
    "duplicates_replaced_declared": lambda: MutantBackend(
        "the reference whose commits take an equal entry over, declaring duplicates=replaced",
        ReplacingKVManager,
        KV_CAPABILITIES | {"fork"},
        variants={"duplicates": "replaced"},
    ),
    "empty_salt_as_no_salt_declared": lambda: MutantBackend(
        "the reference taking the empty salt for none, declaring empty-salt=no-salt",
        EmptySaltIsNoSaltKVManager,
        KV_CAPABILITIES | {"fork"},
        variants={"empty-salt": "no-salt"},
    ),
    "queries_counted_on_lookup_declared": lambda: MutantBackend(
        "the reference counting no query with caching off, declaring query-counting=on-lookup",
        QueriesCountedOnLookupKVManager,
        KV_CAPABILITIES | {"fork"},
        variants={"query-counting": "on-lookup"},
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


def publication_on_schedule_declared() -> MutantBackend:
    """A KVManager publishing pages when allocated, declaring the departure
    (``publication=on-schedule``): the tests it makes fail run as expected failures."""
    return MutantBackend(
        "publishing when scheduled, declared",
        kv.PublishBeforeCommit,
        KV_CAPABILITIES | {"fork"},
        variants={"publication": "on-schedule"},
    )


def publication_on_schedule_declared_falsely() -> MutantBackend:
    """The reference declaring a departure it does not make: its expected failures pass."""
    return MutantBackend(
        "the reference declaring publication=on-schedule",
        variants={"publication": "on-schedule"},
    )


def variants_as_names() -> MutantBackend:
    """Variants declared as bare names, not a mapping of choices: a usage error."""
    return MutantBackend("variants as names", variants=frozenset({"orphans"}))  # type: ignore[arg-type]


def page_sizes_of_two() -> MutantBackend:
    """The reference KVManager declaring it takes page size 2 only (KVM-065): tests at other
    sizes are skipped, naming the size."""
    return MutantBackend("the reference declaring page size 2", page_sizes=frozenset({2}))


def page_sizes_as_an_int() -> MutantBackend:
    """Page sizes declared as a bare int, not a container: a usage error."""
    return MutantBackend("page sizes as an int", page_sizes=2)  # type: ignore[arg-type]
