"""Paired comparisons of two models scored on the same samples, with bootstrap confidence intervals.

The gate compares candidate vs base and candidate vs champion on one eval split: the same
questions answered by both, so the samples are paired and the interval is that of the mean
per-sample difference (scipy.stats.bootstrap, paired, percentile method). The resampling is seeded,
so a rerun on the same scores gives the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Difference:
    """mean(a - b) over paired samples, with its bootstrap interval when a confidence was asked for."""

    value: float
    low: float | None
    high: float | None
    confidence: float | None
    samples: int

    def flipped(self) -> Difference:
        """mean(b - a): the same comparison seen from the other side."""
        low, high = (-self.high if self.high is not None else None), (-self.low if self.low is not None else None)
        return Difference(-self.value, low, high, self.confidence, self.samples)

    def interval(self) -> list[float] | None:
        return None if self.low is None or self.high is None else [self.low, self.high]


def paired_difference(
    a: list[float], b: list[float], confidence: float | None = None, resamples: int = 2000, seed: int = 0
) -> Difference:
    """mean(a - b); with `confidence` (e.g. 0.9) the two-sided bootstrap interval of it."""
    import numpy as np

    if len(a) != len(b):
        raise ValueError(f"paired scores differ in length: {len(a)} vs {len(b)}")
    first, second = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    value = float(np.mean(first - second)) if len(first) else 0.0
    if confidence is None or len(first) < 2:
        return Difference(value, None, None, confidence, len(first))
    from scipy.stats import bootstrap

    result = bootstrap(
        (first, second),
        lambda x, y, axis: np.mean(x - y, axis=axis),
        paired=True,
        vectorized=True,
        confidence_level=confidence,
        n_resamples=resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return Difference(
        value, float(result.confidence_interval.low), float(result.confidence_interval.high), confidence, len(first)
    )
