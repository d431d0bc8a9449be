"""Paired comparisons of two models, with confidence intervals.

- Quality: the gate compares candidate vs base and candidate vs champion on one eval split: the same
  questions answered by both, so the samples are paired and the interval is that of the mean
  per-sample difference (scipy.stats.bootstrap, paired, percentile method). The resampling is seeded,
  so a rerun on the same scores gives the same interval.
- Performance: the benchmark measures both models in interleaved rounds; each round gives one
  candidate/champion ratio, and the interval is Student's t on the mean log ratio (`RatioInterval`).
  A handful of rounds is too few for a bootstrap (8 rounds have 6,435 distinct resamples, most of
  them repeats of one extreme round), and a ratio is symmetric on the log scale: 0.5 and 2 are as
  far from 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["pass", "fail", "inconclusive"]


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


class Decides:
    """A point value with an optional interval (`low`, `high`), decided against a threshold on the interval."""

    value: float
    low: float | None
    high: float | None

    def verdict(self, threshold: float, comparison: Literal[">=", "<="]) -> Verdict:
        """pass when the whole interval is on the right side of the threshold, fail when it is entirely
        on the wrong side, inconclusive when it straddles it (more rounds may decide it)."""
        if self.low is None or self.high is None:
            return "inconclusive"
        if comparison == ">=":
            return "pass" if self.low >= threshold else "fail" if self.high < threshold else "inconclusive"
        return "pass" if self.high <= threshold else "fail" if self.low > threshold else "inconclusive"

    def interval(self) -> list[float] | None:
        return None if self.low is None or self.high is None else [self.low, self.high]


@dataclass(frozen=True)
class RatioInterval(Decides):
    """The geometric mean of paired ratios (candidate/champion, one per round) and its t interval;
    one round measures no spread, so it has no interval (and decides no check)."""

    value: float
    low: float | None
    high: float | None
    confidence: float
    rounds: int


@dataclass(frozen=True)
class MeanInterval(Decides):
    """The mean of one model's repeated benchmark runs (AIPerf's profile runs) and its Student t interval, as
    AIPerf reports it; one run has no interval."""

    value: float
    low: float | None
    high: float | None
    confidence: float
    samples: int


def mean_interval(values: list[float], confidence: float) -> MeanInterval:
    """mean +- t * sd / sqrt(n) over the runs' values."""
    from scipy.stats import t

    if not values:
        raise ValueError("mean_interval needs at least one value")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return MeanInterval(mean, None, None, confidence, len(values))
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))
    half = float(t.ppf((1 + confidence) / 2, len(values) - 1)) * sd / math.sqrt(len(values))
    return MeanInterval(mean, mean - half, mean + half, confidence, len(values))


def ratio_interval(ratios: list[float], confidence: float) -> RatioInterval:
    """exp(mean(log r) +- t * sd(log r) / sqrt(n)) over the rounds' ratios."""
    from scipy.stats import t

    if not ratios or min(ratios) <= 0:
        raise ValueError(f"ratios must be positive: {ratios}")
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return RatioInterval(math.exp(mean), None, None, confidence, len(logs))
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = float(t.ppf((1 + confidence) / 2, len(logs) - 1)) * sd / math.sqrt(len(logs))
    return RatioInterval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), confidence, len(logs))


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (scipy's binomtest); (0, 1) without trials."""
    from scipy.stats import binomtest

    if trials == 0:
        return 0.0, 1.0
    interval = binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="wilson")
    return float(interval.low), float(interval.high)
