"""``/metrics``: Prometheus metrics through ``prometheus_client``, named as vLLM names them.

Request metrics (``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
...) are observed on the engine thread from each output; engine state (``vllm:num_requests_*``,
KV pages, prefix-cache counters) is read from the engine's latest stats at scrape time; process
metrics (CPU, memory, file descriptors, garbage collection) come from ``prometheus_client``'s
own collectors. Every app has its own registry: nothing is global. ``pagedkv_*`` metrics are
what vLLM has no name for: the page pool in pages, steps and computed prefill positions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.registry import Collector

from pagedkv.engine.outputs import EngineStats, RequestOutput

#: Content type of the Prometheus text format that :meth:`ServingMetrics.render` writes.
PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

#: Bucket bounds, seconds, as vLLM's.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
TPOT_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)

_LABELS = ("model_name",)


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: buckets of token counts, as vLLM's."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


@dataclass(frozen=True, slots=True)
class TokenTotals:
    """Tokens counted so far: prompt tokens of requests that produced a first token, and
    generated tokens."""

    prompt: int
    generation: int


class ServingMetrics:
    """Request metrics of one server and their Prometheus registry.

    :meth:`observe` is called on the engine thread; :meth:`render` and :meth:`totals` from any
    thread.
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._lock = threading.Lock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_token_time: dict[str, float] = {}
        reg = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, _LABELS, registry=reg, buckets=buckets)
            return family.labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=reg).labels(model_name)

        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self._tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token (between two tokens of a request) in seconds.",
            TPOT_BUCKETS,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self._decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        self._prompt_hist = histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            token_buckets(max_model_len),
        )
        self._generation_hist = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets(max_model_len),
        )
        self._prompt_counter = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_counter = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*_LABELS, "finished_reason"),
            registry=reg,
        )
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)

    def watch_engine(self, stats: Callable[[], EngineStats]) -> None:
        """Export the engine state that ``stats()`` returns at each scrape."""
        self.registry.register(_EngineCollector(stats, self._model_name))

    def observe(self, output: RequestOutput) -> None:
        """Count one step's output of one request (an abort's final output included)."""
        now = time.perf_counter()
        metrics = output.metrics
        new_tokens = sum(len(c.new_token_ids) for c in output.outputs)  # every completion's
        first = new_tokens > 0 and sum(len(c.token_ids) for c in output.outputs) == new_tokens
        with self._lock:
            self._generation_tokens += new_tokens
            if first:
                self._prompt_tokens += metrics.prompt_tokens
            last = self._last_token_time.pop(output.request_id, None)
            if new_tokens and not output.finished:
                self._last_token_time[output.request_id] = now
        self._generation_counter.inc(new_tokens)
        if first:
            self._prompt_counter.inc(metrics.prompt_tokens)
            if metrics.ttft is not None:
                self._ttft.observe(metrics.ttft)
        if last is not None and new_tokens:
            self._tpot.observe((now - last) / new_tokens)
        if output.finished:
            reason = str(output.finish_reason) if output.finish_reason else "unknown"
            self._success.labels(self._model_name, reason).inc()
            if metrics.finished_time is not None:
                self._e2e.observe(metrics.finished_time - metrics.arrival_time)
            if metrics.queue_time is not None:
                self._queue.observe(metrics.queue_time)
            if metrics.decode_time is not None:
                self._decode.observe(metrics.decode_time)
            self._prompt_hist.observe(metrics.prompt_tokens)
            self._generation_hist.observe(metrics.generated_tokens)

    def totals(self) -> TokenTotals:
        with self._lock:
            return TokenTotals(prompt=self._prompt_tokens, generation=self._generation_tokens)

    def render(self) -> bytes:
        """The ``/metrics`` body in the Prometheus text format 0.0.4."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine state, read from the engine's latest published stats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        label = [self._model_name]
        usage = stats.pages_in_use / stats.num_pages if stats.num_pages else 0.0
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                stats.running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                stats.waiting,
            ),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(label, value)
            yield family
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.query_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.hit_tokens,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                stats.preemptions,
            ),
        )
        for name, doc, value in counters:
            family_c = CounterMetricFamily(name, doc, labels=_LABELS)
            family_c.add_metric(label, value)
            yield family_c
        yield from _pagedkv_metrics(stats)


def _pagedkv_metrics(stats: EngineStats) -> Iterator[Metric]:
    """What vLLM has no name for: the pool in pages, steps, computed prefill positions."""
    pages = (
        ("pagedkv_kv_pages_total", "KV pages in the pool.", stats.num_pages),
        ("pagedkv_kv_pages_in_use", "KV pages held by requests.", stats.pages_in_use),
        ("pagedkv_kv_pages_free", "KV pages neither held nor cached.", stats.pages_free),
        (
            "pagedkv_kv_pages_cached",
            "KV pages held by no request but kept in the prefix cache.",
            stats.pages_cached,
        ),
        ("pagedkv_kv_pages_peak", "Most KV pages in use after any step.", stats.peak_pages_in_use),
        (
            "pagedkv_prefix_cache_hit_rate",
            "Prompt tokens served by the prefix cache over prompt tokens looked up.",
            stats.hit_rate,
        ),
    )
    for name, doc, value in pages:
        yield GaugeMetricFamily(name, doc, value=value)
    yield CounterMetricFamily("pagedkv_engine_steps", "Engine steps run.", value=stats.steps)
    yield CounterMetricFamily(
        "pagedkv_engine_failed_steps",
        "Engine steps whose model run raised; their requests were run again or failed.",
        value=stats.failed_steps,
    )
    yield CounterMetricFamily(
        "pagedkv_prefill_tokens",
        "Prompt positions the model computed (prefix-cache hits excluded).",
        value=stats.prefill_tokens_computed,
    )
