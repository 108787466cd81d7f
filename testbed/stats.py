"""The project's rule for naming a winner: the 95% interval of the difference of two means
(Welch's t interval, unequal variances) must exclude zero; otherwise the two are level."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Interval:
    """mean(a) - mean(b) and its confidence interval [low, high]."""
    difference: float
    low: float
    high: float

    @property
    def verdict(self) -> str:
        """'better' (a above b), 'worse' or 'level', by whether the interval excludes zero."""
        if self.low > 0:
            return "better"
        if self.high < 0:
            return "worse"
        return "level"


def welch(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Interval | None:
    """Welch's interval for mean(a) - mean(b); None when either side has fewer than two
    values (no interval: the two are level by the rule). Samples without spread on both
    sides give the difference itself as the interval."""
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy.stats import t

    difference = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(difference, difference, difference)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(t.ppf(0.5 + confidence / 2, df)) * se
    return Interval(difference, difference - half, difference + half)


def verdict(a: Sequence[float], b: Sequence[float]) -> str:
    """'better', 'worse' or 'level' for a against b by the rule (level without an interval)."""
    interval = welch(a, b)
    return interval.verdict if interval is not None else "level"
