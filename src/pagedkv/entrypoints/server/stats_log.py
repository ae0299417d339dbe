"""The server's log: a startup summary, and a throughput line every few seconds.

Everything goes to the ``pagedkv.server`` logger; ``pagedkv serve --log-level`` sets its level.
The periodic line is logged at INFO while there is traffic and at DEBUG when the server has been
idle for a whole interval, as vLLM does, so an idle server's log stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pagedkv.engine.outputs import EngineStats
from pagedkv.entrypoints.server.async_engine import AsyncEngine
from pagedkv.entrypoints.server.metrics import ServingMetrics, TokenTotals

logger = logging.getLogger("pagedkv.server")


def startup_summary(model_name: str, engine: AsyncEngine, auth: str) -> str:
    """One line saying what is served and under which limits."""
    stats = engine.stats()
    limits = engine.policy.limits
    timeout = limits.request_timeout_s
    return (
        f"serving {model_name!r}: max_model_len {engine.max_model_len}, "
        f"{stats.num_pages} KV pages; limits: {limits.max_prompts_per_request} prompts per "
        f"request, {limits.max_waiting_requests} waiting requests, request timeout "
        f"{'none' if timeout is None else f'{timeout:g} s'}; auth: {auth}"
    )


def throughput_line(
    before: tuple[float, EngineStats, TokenTotals], after: tuple[float, EngineStats, TokenTotals]
) -> str:
    """The throughput between two ``(time.monotonic(), stats, totals)`` readings, and the state
    at the second."""
    seconds = max(after[0] - before[0], 1e-9)
    prompt = (after[1].prefill_tokens_computed - before[1].prefill_tokens_computed) / seconds
    generation = (after[2].generation - before[2].generation) / seconds
    stats = after[1]
    usage = 100 * stats.pages_in_use / stats.num_pages if stats.num_pages else 0.0
    return (
        f"prompt throughput: {prompt:.1f} tokens/s, generation throughput: "
        f"{generation:.1f} tokens/s, running: {stats.running} reqs, waiting: "
        f"{stats.waiting} reqs, KV pages in use: {stats.pages_in_use}/{stats.num_pages} "
        f"({usage:.1f}%), prefix cache hit rate: {100 * stats.hit_rate:.1f}%"
    )


async def log_throughput(engine: AsyncEngine, metrics: ServingMetrics, interval_s: float) -> None:
    """Log :func:`throughput_line` every ``interval_s`` seconds until cancelled."""
    last = (time.monotonic(), engine.stats(), metrics.totals())
    while True:
        await asyncio.sleep(interval_s)
        now = (time.monotonic(), engine.stats(), metrics.totals())
        busy = now[1].steps != last[1].steps or now[1].running or now[1].waiting
        logger.log(logging.INFO if busy else logging.DEBUG, "%s", throughput_line(last, now))
        last = now
