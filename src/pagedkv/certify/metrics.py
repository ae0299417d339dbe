"""Reading the few Prometheus samples a certify run looks at (CRT-041)."""

from __future__ import annotations

#: vLLM's name of the fraction of the KV cache in use (1 means all of it).
KV_USAGE = "vllm:kv_cache_usage_perc"


def sample_sum(text: str, name: str) -> float | None:
    """The sum of every sample of ``name`` (any labels) in Prometheus ``text``; ``None`` when
    there is none."""
    total: float | None = None
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, _, value = line.rpartition(" ")
        if head.partition("{")[0].strip() != name:
            continue
        try:
            total = (total or 0.0) + float(value)
        except ValueError:
            continue
    return total
