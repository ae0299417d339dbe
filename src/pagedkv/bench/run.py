"""What one system's run of one workload measured."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.bench.stats import percentile, ratio, rounded


@dataclass(frozen=True, slots=True)
class RunResult:
    """Counts and timings of one run; every time in seconds (``time.perf_counter`` clock).

    Attributes:
        system: the system's name, e.g. ``pagedkv-v1``.
        output_tokens: tokens generated, all requests together.
        wall_s: from the first request submitted to the last token, seconds.
        ttft_s: per request, from submission to its first token, seconds.
        decode_s: per request, from its first token to its last, seconds.
        decode_tokens: per request, tokens generated after the first.
    """

    system: str
    output_tokens: int
    wall_s: float
    ttft_s: tuple[float, ...]
    decode_s: tuple[float, ...] = ()
    decode_tokens: tuple[int, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return ratio(self.output_tokens, self.wall_s)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second of decode time, all requests together."""
        return ratio(sum(self.decode_tokens), sum(self.decode_s))

    def summary(self) -> dict[str, float | int | str | None]:
        """JSON figures: throughput (tokens/s), TTFT p50/p99 (ms), counts."""
        return {
            "system": self.system,
            "output_tokens": self.output_tokens,
            "wall_s": rounded(self.wall_s),
            "output_tokens_per_s": rounded(self.tokens_per_s, 2),
            "ttft_p50_ms": rounded(percentile(self.ttft_s, 50) * 1e3, 2),
            "ttft_p99_ms": rounded(percentile(self.ttft_s, 99) * 1e3, 2),
        }
