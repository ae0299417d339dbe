"""Named variants: the one way a backend declares where it differs from the reference.

Two correct backends may legitimately differ where the spec leaves room (SQLAlchemy's suite
calls such differences requirements, open or closed per dialect), and a real backend may knowingly
depart from a requirement's text for reasons of its own (vLLM publishes a block when it is
scheduled, not when its K/V are written). Either way the backend says so in an optional
``variants`` mapping of variant names to choices, and the suite never picks one backend's
behaviour as "the" answer:

* a choice in a **room** of the spec (``departs_from`` empty) is followed by the suite: the
  oracles and the example tests expect what the declared choice says;
* a choice that **departs** from a requirement, or that the oracles do not model, lists the
  tests it makes fail (``fails``): the plugin runs them as strict expected failures whose
  reason names the variant, so a declared departure can never hide a passing test (strict: an
  XPASS fails the run) nor silently skip one.

A backend that declares nothing gets each variant's default (the reference's choice).

::

    @dataclass(frozen=True)
    class MyBackend:
        name: str = "mine"
        capabilities: frozenset[str] = frozenset({"prefix_caching", "eviction"})
        variants: Mapping[str, str] = field(default_factory=lambda: {"orphans": "detach"})

The variants are specified in ``specs/kv-manager.md`` (section "Variants").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Choice:
    """One legal declaration of a variant.

    Attributes:
        meaning: what a backend that declares it does.
        departs_from: requirement IDs whose text a backend declaring it does not follow; empty
            where the spec leaves the room open.
        fails: tests (file-relative node ids, ``test_x.py::Class::test``) a backend declaring
            it fails, run as strict expected failures; empty when the suite follows the choice.
        observable: ``False`` when no test can observe the choice at all (then ``fails`` is
            empty and the report says so).
    """

    meaning: str
    departs_from: tuple[str, ...] = ()
    fails: tuple[str, ...] = ()
    observable: bool = True


@dataclass(frozen=True, slots=True)
class Variant:
    """One place where backends may differ, and the choices a backend may declare.

    Attributes:
        name: the key in a backend's ``variants`` mapping.
        choices: each legal choice, by name.
        default: the choice assumed when a backend declares none (the reference's).
        requirement: the spec ID the variant is about (the room, or the requirement a
            departure leaves).
    """

    name: str
    choices: Mapping[str, Choice]
    default: str
    requirement: str


KVM = "test_kv_manager.py::TestKVManager::"
MATCH = "test_kv_match.py::TestKVMatch::"
FORK = "test_kv_fork.py::TestKVFork::"
STATE_MACHINE = "test_kv_state_machine.py::TestKVStateMachine::test_kv_manager_matches_the_oracle"
ORPHAN_EXAMPLE = (
    "test_kv_variants.py::TestKVVariants::test_orphaned_entries_follow_the_declared_variant"
)
FORK_AFTER_ORPHAN_EXAMPLE = (
    "test_kv_variants.py::TestKVVariants::"
    "test_a_fork_publishes_as_its_parent_would_after_the_orphan_example"
)
DUPLICATE_EXAMPLE = (
    "test_kv_variants.py::TestKVVariants::test_duplicate_publication_follows_the_declared_variant"
)
IN_FLIGHT_TESTS = tuple(
    MATCH + name
    for name in (
        "test_uncommitted_pages_are_in_flight_never_hit",
        "test_in_flight_needs_the_same_tokens_and_salt",
        "test_in_flight_leaves_a_token_to_compute",
        "test_a_chunked_allocation_puts_its_whole_prompt_in_flight",
        "test_freeing_ends_in_flight",
    )
)

#: KVM-050: what becomes of prefix entries whose parent entry was evicted.
ORPHANS = Variant(
    name="orphans",
    choices={
        "block": Choice(
            "an orphan is never hit; it keeps its key until evicted itself, and a commit that "
            "reaches its key stops publishing for that sequence (chained-hash index)"
        ),
        "detach": Choice(
            "an orphan is never hit; a commit that reaches its prefix publishes its own page "
            "beside it (radix tree)"
        ),
        "reattach": Choice(
            "an orphan is hit again once its prefix is published again, and a commit that "
            "reaches its prefix continues the chain from it (index keyed by the whole prefix)"
        ),
    },
    default="block",
    requirement="KVM-050",
)

#: KVM-051: a commit reaching a page whose prefix another page already publishes.
DUPLICATES = Variant(
    name="duplicates",
    choices={
        "kept-once": Choice(
            "the existing entry is kept and the committing page stays unpublished (it goes "
            "free, not cached, when freed); the chain continues from the existing entry"
        ),
        "published": Choice(
            "the committing page is published too, beside the existing one, under the same "
            "prefix (an index mapping a content key to every page holding it); the state "
            "machine's oracle does not model it, and the orphan example assumes kept-once",
            fails=(STATE_MACHINE, ORPHAN_EXAMPLE),
        ),
        "replaced": Choice(
            "the committing page takes the entry over (latest wins): the existing entry is "
            "dropped, its page goes free once unheld (at once if cached), entries published "
            "after it are orphaned (KVM-050), and the committing page is published in its "
            "place; the oracle and the example tests follow it"
        ),
    },
    default="kept-once",
    requirement="KVM-051",
)

#: A departure from KVM-021: pages published before their K/V are written.
PUBLICATION = Variant(
    name="publication",
    choices={
        "on-commit": Choice("a page is published only by commit, after its K/V are written"),
        "on-schedule": Choice(
            "a full page is published when the tokens that fill it are scheduled (allocate, "
            "grow), before a step writes them: safe only behind an engine that runs every "
            "scheduled step, in order, before a later step reads the cache",
            departs_from=("KVM-021",),
            fails=(
                KVM + "test_nothing_is_hit_before_commit",
                KVM + "test_only_full_pages_are_published",
                KVM + "test_stats_count_what_happened",
                # pages published when scheduled are hits at once, never in flight
                *IN_FLIGHT_TESTS,
                MATCH + "test_pages_found_already_published_are_not_in_flight",
                MATCH + "test_a_partly_committed_shared_prompt_stays_consistent",
                # commit publishes nothing already scheduled
                FORK + "test_pages_shared_by_a_fork_are_published_once",
                FORK + "test_the_second_to_commit_a_shared_page_publishes_what_follows",
                FORK + "test_a_fork_has_no_pages_in_flight",
                ORPHAN_EXAMPLE,
                FORK_AFTER_ORPHAN_EXAMPLE,
                DUPLICATE_EXAMPLE,
                STATE_MACHINE,
            ),
        ),
    },
    default="on-commit",
    requirement="KVM-021",
)

#: A departure from KVM-036: no record of pages live sequences are computing.
IN_FLIGHT = Variant(
    name="in-flight",
    choices={
        "tracked": Choice(
            "a match reports the pages right after its hits that live sequences are computing"
        ),
        "untracked": Choice(
            "a match reports no page in flight: a page being computed is invisible to a lookup "
            "until it is published, so two requests may compute the same prefix",
            departs_from=("KVM-036",),
            fails=IN_FLIGHT_TESTS,
        ),
    },
    default="tracked",
    requirement="KVM-036",
)

#: A departure from KVM-024: cached and free pages in one queue, cached ones evicted in turn.
EVICTION = Variant(
    name="eviction",
    choices={
        "free-first": Choice(
            "a cached page is evicted only when the free list is empty, least recently "
            "released first"
        ),
        "one-queue": Choice(
            "every unheld page, cached or free, waits in one queue, least recently released "
            "first, and a fresh page is the queue's head, evicted if cached: a cached page may "
            "be evicted while a free page remains (vLLM v1's free_block_queue); hits stay "
            "correct, and the state machine's oracle follows it",
            departs_from=("KVM-024",),
            fails=(KVM + "test_eviction_is_lru_tail_first_and_only_when_free_list_is_empty",),
        ),
    },
    default="free-first",
    requirement="KVM-024",
)

#: A departure from KVM-030: query tokens counted only by requests that looked the cache up.
QUERY_COUNTING = Variant(
    name="query-counting",
    choices={
        "every-allocation": Choice(
            "query_tokens counts the prompt tokens of every successful allocate, caching on or off"
        ),
        "on-lookup": Choice(
            "query and hit tokens are counted only for allocations that looked the prefix cache "
            "up: with prefix caching disabled both stay 0 (statistics only)",
            departs_from=("KVM-030",),
            fails=(KVM + "test_disabled_prefix_caching_publishes_and_hits_nothing", STATE_MACHINE),
        ),
    },
    default="every-allocation",
    requirement="KVM-030",
)

#: A departure from KVM-022: a hit trusted on its (cryptographic) hash alone.
HIT_VERIFICATION = Variant(
    name="hit-verification",
    choices={
        "verified": Choice("a hit is verified against the stored tokens, the salt and the parent"),
        "hash-trusted": Choice(
            "a hit is trusted on its chained hash alone, no tokens stored to compare: safe with "
            "a cryptographic hash, where no test can find a collision",
            departs_from=("KVM-022",),
            observable=False,
        ),
    },
    default="verified",
    requirement="KVM-022",
)

#: A departure from KVM-028: the empty salt taken for no salt.
EMPTY_SALT = Variant(
    name="empty-salt",
    choices={
        "a-salt": Choice("the empty string is a salt like any other"),
        "no-salt": Choice(
            "a request salted with the empty string shares pages with unsalted requests: safe "
            "only where the front end refuses empty salts",
            departs_from=("KVM-028",),
            fails=(KVM + "test_empty_salt_is_a_salt_of_its_own",),
        ),
    },
    default="a-salt",
    requirement="KVM-028",
)

#: Every variant the suite knows, by name.
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        ORPHANS,
        DUPLICATES,
        PUBLICATION,
        IN_FLIGHT,
        EVICTION,
        QUERY_COUNTING,
        HIT_VERIFICATION,
        EMPTY_SALT,
    )
}


class VariantError(ValueError):
    """A backend declares variants in another form than a mapping, an unknown variant or an
    unknown choice."""


def declared_variants(backend: object) -> dict[str, str]:
    """The backend's choice for every known variant, completed with the defaults.

    ``variants`` is optional; if present it maps variant names to choices.

    Raises:
        VariantError: ``variants`` is not such a mapping, or names an unknown variant or choice.
    """
    raw: object = getattr(backend, "variants", None) or {}
    if not isinstance(raw, Mapping):
        raise VariantError(
            "'variants' must be a mapping of variant names to choices, e.g. {'orphans': 'detach'}"
        )
    chosen = {name: variant.default for name, variant in VARIANTS.items()}
    for name, choice in raw.items():
        if not isinstance(name, str) or not isinstance(choice, str):
            raise VariantError("'variants' must map variant names (str) to choices (str)")
        variant = VARIANTS.get(name)
        if variant is None:
            raise VariantError(f"unknown variant {name!r}; known: {sorted(VARIANTS)}")
        if choice not in variant.choices:
            raise VariantError(
                f"variant {name!r} has no choice {choice!r}; choices: {sorted(variant.choices)}"
            )
        chosen[name] = choice
    return chosen


def tracks_in_flight(chosen: Mapping[str, str]) -> bool:
    """Whether a backend with the ``chosen`` variants reports pages in flight (KVM-036): it
    does not declare the departure ``in-flight=untracked``. Tests observing in-flight pages
    in passing expect none from a backend that declares it."""
    return chosen.get(IN_FLIGHT.name, IN_FLIGHT.default) == "tracked"


def departures(chosen: Mapping[str, str]) -> dict[str, str]:
    """The choices of ``chosen`` that are not the default, as ``name=choice`` by name."""
    return {
        name: f"{name}={choice}"
        for name, choice in chosen.items()
        if choice != VARIANTS[name].default
    }


def expected_failures(chosen: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Every test the declared ``chosen`` variants make fail (file-relative node id), with the
    ``name=choice`` declarations that do."""
    failing: dict[str, tuple[str, ...]] = {}
    for name, choice in chosen.items():
        for node_id in VARIANTS[name].choices[choice].fails:
            failing[node_id] = (*failing.get(node_id, ()), f"{name}={choice}")
    return failing
