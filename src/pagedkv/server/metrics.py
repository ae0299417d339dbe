"""Serving counters and their Prometheus text exposition (format 0.0.4)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.engine.outputs import EngineStats, RequestOutput

#: Upper bounds (seconds) of the time-to-first-token histogram buckets; ``+Inf`` is implied.
TTFT_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: Content type of the Prometheus text format.
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """A consistent copy of :class:`ServingMetrics`.

    Attributes:
        ttft_bucket_counts: per bucket of :data:`TTFT_BUCKETS`, requests whose first token came
            within it (not cumulative).
        ttft_sum: seconds, over every observed first token.
        ttft_count: first tokens observed.
        generation_tokens: tokens generated, all requests.
        prompt_tokens: prompt tokens of finished requests.
        finished: finished requests per finish reason.
    """

    ttft_bucket_counts: tuple[int, ...]
    ttft_sum: float
    ttft_count: int
    generation_tokens: int
    prompt_tokens: int
    finished: tuple[tuple[str, int], ...]


class ServingMetrics:
    """Counters updated by the engine thread from each output and read by ``/metrics``.

    Every method is thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets = [0] * len(TTFT_BUCKETS)
        self._ttft_sum = 0.0
        self._ttft_count = 0
        self._generation_tokens = 0
        self._prompt_tokens = 0
        self._finished: dict[str, int] = {}

    def observe(self, output: RequestOutput) -> None:
        """Count one step's output of one request (an abort's final output included)."""
        with self._lock:
            self._generation_tokens += len(output.new_token_ids)
            first = bool(output.new_token_ids) and len(output.token_ids) == len(
                output.new_token_ids
            )
            ttft = output.metrics.ttft
            if first and ttft is not None:
                self._ttft_sum += ttft
                self._ttft_count += 1
                for i, bound in enumerate(TTFT_BUCKETS):
                    if ttft <= bound:
                        self._buckets[i] += 1
                        break
            if output.finished:
                self._prompt_tokens += len(output.prompt_token_ids)
                reason = str(output.finish_reason) if output.finish_reason else "unknown"
                self._finished[reason] = self._finished.get(reason, 0) + 1

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(
                ttft_bucket_counts=tuple(self._buckets),
                ttft_sum=self._ttft_sum,
                ttft_count=self._ttft_count,
                generation_tokens=self._generation_tokens,
                prompt_tokens=self._prompt_tokens,
                finished=tuple(sorted(self._finished.items())),
            )


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _family(
    lines: list[str], name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]
) -> None:
    """Append one metric family; each sample is ``(suffix_and_labels, value)``."""
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    lines.extend(f"{name}{suffix} {_number(value)}" for suffix, value in samples)


def render_prometheus(stats: EngineStats, metrics: MetricsSnapshot) -> str:
    """The ``/metrics`` body: KV pool, prefix cache, queues, preemptions, tokens and TTFT."""
    lines: list[str] = []
    gauges = (
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
        ("pagedkv_requests_running", "Requests holding KV pages.", stats.running),
        ("pagedkv_requests_waiting", "Requests queued for admission.", stats.waiting),
    )
    for name, help_text, value in gauges:
        _family(lines, name, "gauge", help_text, [("", value)])
    counters = (
        (
            "pagedkv_prefix_cache_query_tokens_total",
            "Prompt tokens looked up in the prefix cache.",
            stats.query_tokens,
        ),
        (
            "pagedkv_prefix_cache_hit_tokens_total",
            "Prompt tokens served by the prefix cache.",
            stats.hit_tokens,
        ),
        ("pagedkv_preemptions_total", "Requests preempted for lack of pages.", stats.preemptions),
        ("pagedkv_engine_steps_total", "Engine steps run.", stats.steps),
        (
            "pagedkv_prefill_tokens_total",
            "Prompt positions the model computed.",
            stats.prefill_tokens_computed,
        ),
        ("pagedkv_generation_tokens_total", "Tokens generated.", metrics.generation_tokens),
        (
            "pagedkv_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            metrics.prompt_tokens,
        ),
    )
    for name, help_text, value in counters:
        _family(lines, name, "counter", help_text, [("", value)])
    _family(
        lines,
        "pagedkv_requests_finished_total",
        "counter",
        "Finished requests by finish reason.",
        [(f'{{finish_reason="{reason}"}}', count) for reason, count in metrics.finished],
    )
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for bound, count in zip(TTFT_BUCKETS, metrics.ttft_bucket_counts, strict=True):
        cumulative += count
        buckets.append((f'_bucket{{le="{_number(bound)}"}}', cumulative))
    buckets.append(('_bucket{le="+Inf"}', metrics.ttft_count))
    buckets.append(("_sum", metrics.ttft_sum))
    buckets.append(("_count", metrics.ttft_count))
    _family(
        lines,
        "pagedkv_time_to_first_token_seconds",
        "histogram",
        "Seconds from a request's arrival to its first generated token.",
        buckets,
    )
    return "\n".join(lines) + "\n"
