"""Conditions shared by the catalogue's domains: one series against a bound, pooled rates judged
by their Wilson lower confidence bound."""

from __future__ import annotations

import math
from typing import Callable

from .history import History, Verdicts


def wilson_lower(k: float, n: float, z: float) -> float:
    """Wilson score lower confidence bound of a binomial rate (k successes in n trials); 0 when n = 0."""
    if n <= 0:
        return 0.0
    p = min(1.0, max(0.0, k / n))
    denom = 1.0 + z * z / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(max(0.0, p * (1 - p) / n + z * z / (4 * n * n)))
    return max(0.0, (centre - margin) / denom)


def one(value: float | None, raise_: bool, hold: bool) -> Verdicts:
    return {} if value is None else {(): (value, raise_, hold)}


def rate(num: str, den: str, last: int, param: str, den_labels: Callable[[tuple], tuple]
          ) -> Callable[[History], Verdicts]:
    """A counter ratio over the last ``last`` steps: opens when its Wilson lower bound exceeds the
    threshold, holds while the point estimate stays above ``hold_fraction`` of it."""
    def condition(h: History) -> Verdicts:
        nums, dens = h.increments(num, last), h.increments(den, last)
        out: Verdicts = {}
        bound, z = h.p(param), h.p("evidence_z")
        for labels, k in nums.items():
            d = dens.get(den_labels(labels))
            if d:
                lower = wilson_lower(k, d, z)
                out[labels] = (k / d, lower > bound, k / d > h.p("hold_fraction") * bound)
        return out
    return condition


def gauge_rate(ratio: str, total: str, last: int, param: str, kinds: tuple[str, ...] | None = None
                ) -> Callable[[History], Verdicts]:
    """A per-step ratio gauge pooled over the last ``last`` steps, weighted by the ``total`` gauge."""
    def condition(h: History) -> Verdicts:
        out: Verdicts = {}
        bound, z = h.p(param), h.p("evidence_z")
        for labels in h.family(ratio):
            if kinds is not None and labels[0] not in kinds:
                continue
            k = n = 0.0
            for _, values in h.steps[-last:]:
                r, t = values.get(ratio, {}).get(labels), values.get(total, {}).get(())
                if r is not None and t:
                    k, n = k + r * t, n + t
            if n:
                out[labels] = (k / n, wilson_lower(k, n, z) > bound, k / n > h.p("hold_fraction") * bound)
        return out
    return condition


__all__ = ["gauge_rate", "one", "rate", "wilson_lower"]
