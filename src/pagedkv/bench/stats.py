"""Small statistics helpers: percentiles, medians and safe ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (``0 <= q <= 100``) by linear interpolation; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    """The 50th percentile; NaN if empty."""
    return percentile(values, 50.0)


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN when the denominator is zero or either is NaN."""
    if denominator == 0 or math.isnan(numerator) or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def rounded(value: float, digits: int = 4) -> float | None:
    """``value`` rounded for JSON; ``None`` for NaN or infinity (JSON has neither)."""
    if math.isnan(value) or math.isinf(value):
        return None
    return round(value, digits)
