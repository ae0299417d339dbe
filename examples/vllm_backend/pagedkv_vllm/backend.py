"""The backends the conformance suite loads: ``--backend pagedkv_vllm.backend:backend``.

Two factories, one per way vLLM's scheduler drives its KV cache manager (see
:class:`~pagedkv_vllm.manager.Publish`):

* :func:`backend`: blocks published when their tokens are scheduled (vLLM's everyday path);
* :func:`deferred_backend`: blocks published by pagedkv's ``commit`` (vLLM's
  ``delay_cache_blocks`` / ``cache_blocks`` path, used for asynchronously loaded KV).

Each declares the capabilities it honestly has and, as data, its choice in each of the suite's
variants where vLLM differs from pagedkv's reference (``pagedkv_conformance.variants``; the
reasons are in :mod:`pagedkv_vllm.variants`): the suite follows a choice it models and runs the
tests a departure makes fail as strict expected failures naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.interfaces import KVManager, KVManagerConfig

from .manager import Publish, VLLMKVManager
from .variants import DEFERRED_VARIANTS, SCHEDULED_VARIANTS


@dataclass(frozen=True)
class VLLMBackend:
    """vLLM's v1 ``KVCacheManager`` as a pagedkv backend (KVManager only).

    Attributes:
        name: shown in the report header.
        publish: when vLLM publishes a full block to its prefix cache.
        capabilities: prefix caching, LRU eviction and reset: vLLM has all three. No engine,
            model runner or paged store: the adapter covers the KV cache manager alone.
        variants: vLLM's choice in each variant of the suite where it differs from the
            reference (``{"publication": "on-schedule", ...}``).
    """

    name: str
    publish: Publish
    variants: Mapping[str, str]
    capabilities: frozenset[str] = frozenset({"prefix_caching", "eviction", "reset"})

    def create_kv_manager(self, config: KVManagerConfig) -> KVManager:
        return VLLMKVManager(config, self.publish)


def backend() -> VLLMBackend:
    """vLLM's KV cache manager as its scheduler drives it for locally computed tokens."""
    return VLLMBackend(
        name="vLLM v1 KVCacheManager (blocks published when scheduled)",
        publish=Publish.ON_SCHEDULE,
        variants=SCHEDULED_VARIANTS,
    )


def deferred_backend() -> VLLMBackend:
    """vLLM's KV cache manager with publication deferred to pagedkv's ``commit``."""
    return VLLMBackend(
        name="vLLM v1 KVCacheManager (blocks published on commit)",
        publish=Publish.ON_COMMIT,
        variants=DEFERRED_VARIANTS,
    )
