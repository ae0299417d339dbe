"""The one place that picks a scheduler for a cache mode; it stands above both
implementations, which stand above their common base."""

from __future__ import annotations

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.sched.paged import PagedScheduler
from pagedkv.engine.sched.recompute import RecomputeScheduler
from pagedkv.engine.sched.scheduler import Scheduler
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import KVManager


def make_scheduler(
    config: EngineConfig,
    kv_manager: KVManager | None,
    *,
    eos_ids: frozenset[int],
    max_model_len: int,
) -> Scheduler:
    """The scheduler of ``config.mode``: paged over ``kv_manager`` (v1, which needs one) or
    recomputing (v0, which must not be given one).

    Raises:
        InvalidRequest: a v1 config without a KVManager, or a v0 config with one.
    """
    if config.mode == "v0":
        if kv_manager is not None:
            raise InvalidRequest("a v0 engine keeps no KV cache: it takes no kv_manager")
        return RecomputeScheduler(config, eos_ids, max_model_len)
    if kv_manager is None:
        raise InvalidRequest("a v1 engine needs a kv_manager; a backend's create_engine builds one")
    return PagedScheduler(config, kv_manager, eos_ids, max_model_len)
