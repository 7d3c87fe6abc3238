"""Conditions shared by the catalogue's domains: one value past a bound (:func:`past`, :func:`latest_past`),
pooled rates judged by their Wilson lower confidence bound (:func:`rate`, :func:`gauge_rate`)."""

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


def past(h: History, value: float | None, bound: float, below: bool = False, hold: float | None = None,
         shown: float | None = None) -> Verdicts:
    """One value against ``bound``: raises above it (``below``: under it), holds while past ``hold``
    (by default ``hold_fraction`` x the bound above it, the bound / ``hold_fraction`` under it). The
    verdict's value is ``shown`` (default: ``value``); no verdict when ``value`` is None."""
    if value is None:
        return {}
    if hold is None:
        hold = bound / h.p("hold_fraction") if below else h.p("hold_fraction") * bound
    if below:
        return {(): (value if shown is None else shown, value < bound, value < hold)}
    return {(): (value if shown is None else shown, value > bound, value > hold)}


def latest_past(name: str, param: str, below: bool = False) -> Callable[[History], Verdicts]:
    """The latest value of series ``name`` (no labels) past the threshold ``param`` (see :func:`past`)."""
    def condition(h: History) -> Verdicts:
        return past(h, h.latest(name), h.p(param), below=below)
    return condition


def _wilson(h: History, k: float, n: float, bound: float) -> tuple[float, bool, bool]:
    """A pooled rate k/n: raises when its Wilson lower bound exceeds ``bound``, holds while the point
    estimate stays above ``hold_fraction`` of it."""
    return k / n, wilson_lower(k, n, h.p("evidence_z")) > bound, k / n > h.p("hold_fraction") * bound


def rate(num: str, den: str, last: int, param: str, den_labels: Callable[[tuple], tuple]
          ) -> Callable[[History], Verdicts]:
    """A counter ratio over the last ``last`` steps: opens when its Wilson lower bound exceeds the
    threshold, holds while the point estimate stays above ``hold_fraction`` of it."""
    def condition(h: History) -> Verdicts:
        nums, dens = h.increments(num, last), h.increments(den, last)
        out: Verdicts = {}
        for labels, k in nums.items():
            d = dens.get(den_labels(labels))
            if d:
                out[labels] = _wilson(h, k, d, h.p(param))
        return out
    return condition


def gauge_rate(ratio: str, total: str, last: int, param: str, kinds: tuple[str, ...] | None = None
                ) -> Callable[[History], Verdicts]:
    """A per-step ratio gauge pooled over the last ``last`` steps, weighted by the ``total`` gauge."""
    def condition(h: History) -> Verdicts:
        out: Verdicts = {}
        for labels in h.family(ratio):
            if kinds is not None and labels[0] not in kinds:
                continue
            k = n = 0.0
            for _, values in h.steps[-last:]:
                r, t = values.get(ratio, {}).get(labels), values.get(total, {}).get(())
                if r is not None and t:
                    k, n = k + r * t, n + t
            if n:
                out[labels] = _wilson(h, k, n, h.p(param))
        return out
    return condition


__all__ = ["gauge_rate", "latest_past", "one", "past", "rate", "wilson_lower"]
