"""Percentiles and summaries for latency samples (no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, std, min, max and p50/p90/p99 of ``values`` multiplied by ``scale`` (e.g. 1000 for ms).
    All None when there are no values (None, not NaN, so the JSON stays standard)."""
    xs = [v * scale for v in values]
    if not xs:
        return dict.fromkeys(("mean", "std", "min", "max", *(f"p{p}" for p in PERCENTILES)))
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    out = {"mean": mean, "std": std, "min": min(xs), "max": max(xs)}
    out.update({f"p{p}": percentile(xs, p) for p in PERCENTILES})
    return out
