"""Name the likely cause of a sampler-learner mismatch from its signature, with the evidence.

The per-token log-ratios r = log pi_old - log mu carry a fingerprint of what made them:

- ``weight_sync_missing``: the maximum lag grows by about one per trainer update, without bound.
- ``temperature_mismatch``: r is linear in the sampler log-prob (slope near T_s/T_t - 1) from the
  first steps, lag or no lag.
- ``top_p_truncation``: a one-signed offset (r <= 0: the sampler renormalised over the kept mass)
  with a flat slope, often with -inf sampler log-probs (excluded tokens that were sampled anyway).
- ``stale_weights``: the mismatch grows with the version lag.
- ``numeric_noise``: zero-mean r, concentrated on low-probability tokens, present at lag 0.
- ``none``: no measurable mismatch.

:func:`diagnose` reads per-step values (as the signals produce them, from a live run or a run
store). :class:`Diagnoser` is the ``Watch`` listener that exports ``rlwatch_diagnosis_info``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .values import Values, value_of as _get

CAUSES = ("none", "numeric_noise", "stale_weights", "weight_sync_missing", "temperature_mismatch",
          "top_p_truncation")


@dataclass
class Diagnosis:
    cause: str
    confidence: str                       # "low" | "medium" | "high"
    evidence: list[str] = field(default_factory=list)
    features: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"cause": self.cause, "confidence": self.confidence, "evidence": self.evidence,
                "features": {k: v for k, v in self.features.items() if v is not None and math.isfinite(v)}}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _centred_sums(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(sum of (x - mean)^2, sum of (y - mean)^2, sum of (x - mean)(y - mean))."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    return (sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys),
            sum((x - mx) * (y - my) for x, y in zip(xs, ys)))


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys on xs (None under 3 points or for constant xs)."""
    if len(xs) < 3:
        return None
    sxx, _, sxy = _centred_sums(xs, ys)
    return None if sxx == 0 else sxy / sxx


def _corr(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation (None under 4 points or when either side is constant)."""
    if len(xs) < 4:
        return None
    sxx, syy, sxy = _centred_sums(xs, ys)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def features(steps: Iterable[Mapping]) -> dict[str, float | None]:
    """Summary features of a window of steps (each one step's values, live or stored)."""
    steps = list(steps)
    rows = [s for s in steps if _get(s, "mismatch_abs_log_ratio_mean") is not None]
    abs_mean = [_get(s, "mismatch_abs_log_ratio_mean") for s in rows]
    signed = [_get(s, "mismatch_log_ratio_mean") for s in rows]
    slopes = [v for s in rows if (v := _get(s, "mismatch_log_ratio_slope")) is not None]
    lag_rows = [s for s in rows if _get(s, "version_lag_mean") is not None]
    tokens = sum(_get(s, "tokens") or 0.0 for s in steps)
    nonfinite = sum(_get(s, "nonfinite_tokens") or 0.0 for s in steps)
    low = [v for s in rows if (v := _get(s, "mismatch_abs_log_ratio_by_prob", ("0.0-0.1",))) is not None]
    high = [v for s in rows if (v := _get(s, "mismatch_abs_log_ratio_by_prob", ("0.9-1.0",))) is not None]
    versions = [(_get(s, "trainer_version"), _get(s, "version_lag_max")) for s in steps]
    versions = [(v, m) for v, m in versions if v is not None and m is not None]
    sorted_slopes = sorted(slopes)
    return {
        "steps": float(len(rows)),
        "abs_mean": _mean(abs_mean),
        "signed_mean": _mean(signed),
        "slope": sorted_slopes[len(sorted_slopes) // 2] if sorted_slopes else None,
        "nonfinite_fraction": nonfinite / tokens if tokens else None,
        "lag_mean": _mean([_get(s, "version_lag_mean") for s in lag_rows]),
        "lag_max": max((m for _, m in versions), default=None),
        "lag_growth_per_version": _slope([v for v, _ in versions], [m for _, m in versions]),
        "mismatch_lag_corr": _corr([_get(s, "version_lag_mean") for s in lag_rows],
                                   [_get(s, "mismatch_abs_log_ratio_mean") for s in lag_rows]),
        "low_prob_abs": _mean(low),
        "high_prob_abs": _mean(high),
        "staleness_bound": next((b for s in reversed(steps) if (b := _get(s, "staleness_bound")) is not None),
                                None),
    }


def diagnose(steps: Iterable[Mapping]) -> Diagnosis:
    """The most likely cause over a window of steps, with the evidence for it."""
    f = features(steps)
    abs_mean, signed, slope = f["abs_mean"], f["signed_mean"], f["slope"]
    lag_mean, lag_max, growth = f["lag_mean"], f["lag_max"], f["lag_growth_per_version"]
    nonfinite = f["nonfinite_fraction"] or 0.0
    if abs_mean is None:
        return Diagnosis("none", "low", ["no step carried both sampler and trainer log-probs"], f)
    one_signed = abs(signed or 0.0) / abs_mean if abs_mean > 0 else 0.0
    # 1. The weight sync is missing: the maximum lag climbs with every update.
    if growth is not None and growth > 0.7 and (lag_max or 0) > max(2.0, 2 * (f["staleness_bound"] or 0)):
        return Diagnosis("weight_sync_missing", "high" if growth > 0.9 else "medium", [
            f"maximum version lag grows {growth:.2f} per trainer update and reached {lag_max:.0f}",
            "the sampler keeps generating with weights that are never replaced"], f)
    # 2. A temperature mismatch: r linear in log mu with a clear slope, at any lag.
    if slope is not None and abs(slope) > 0.1 and abs_mean > 0.01 and (lag_mean or 0.0) < 1.0:
        return Diagnosis("temperature_mismatch", "high" if abs(slope) > 0.2 else "medium", [
            f"log-ratio is linear in the sampler log-prob: slope {slope:+.3f} (a sampler temperature T_s against "
            f"the trainer's T_t gives roughly T_s/T_t - 1)",
            f"mean signed log-ratio {signed:+.4f} nats at mean lag {lag_mean or 0:.2f}"], f)
    # 3. Top-p/top-k truncation: a one-signed negative offset, flat in log mu, often -inf log-probs.
    if signed is not None and signed < -0.005 and one_signed > 0.8 and (slope is None or abs(slope) <= 0.1) \
            and (lag_mean or 0.0) < 1.0:
        evidence = [f"constant offset: mean signed log-ratio {signed:+.4f} nats is {one_signed:.0%} of the mean "
                    f"|log-ratio| (log of the kept probability mass)",
                    f"flat in the sampler log-prob (slope {slope if slope is not None else float('nan'):+.3f})"]
        if nonfinite > 0:
            evidence.append(f"{nonfinite:.2%} of tokens have a -inf or NaN log-prob (sampled outside the kept set)")
        return Diagnosis("top_p_truncation", "high" if nonfinite > 0 or one_signed > 0.95 else "medium", evidence, f)
    # 4. Stale weights: mismatch that comes with lag.
    corr = f["mismatch_lag_corr"]
    if lag_mean is not None and lag_mean >= 0.5 and (corr is None or corr > 0.3):
        return Diagnosis("stale_weights", "high" if (corr or 0) > 0.6 or lag_mean >= 2 else "medium", [
            f"mean version lag {lag_mean:.2f} updates (max {lag_max:.0f})",
            f"mismatch follows the lag (correlation {corr:+.2f})" if corr is not None else
            f"mean |log-ratio| {abs_mean:.4f} nats with stale tokens present"], f)
    if abs_mean < 1e-4:
        return Diagnosis("none", "high", [f"mean |log-ratio| {abs_mean:.2e} nats"], f)
    # 5. Numeric noise: zero-mean, on low-probability tokens, at lag 0.
    low, high = f["low_prob_abs"], f["high_prob_abs"]
    evidence = [f"zero-mean: signed mean {signed:+.2e} against mean |log-ratio| {abs_mean:.2e} nats"]
    concentrated = low is not None and high is not None and low > 2 * high
    if concentrated:
        evidence.append(f"concentrated on low-probability tokens: {low:.3g} nats below p=0.1 against {high:.3g} "
                        f"above p=0.9")
    evidence.append(f"present at lag {lag_mean or 0:.2f}")
    return Diagnosis("numeric_noise", "high" if one_signed < 0.2 and concentrated else "medium", evidence, f)


class Diagnoser:
    """A ``Watch`` listener: diagnoses over the last ``window`` steps every ``every`` steps and exports
    ``rlwatch_diagnosis_info{cause, confidence}``."""

    def __init__(self, window: int = 30, every: int = 5, staleness_bound: float | None = None) -> None:
        self.window: deque = deque(maxlen=window)
        self.staleness_bound = staleness_bound
        self.every = every
        self.latest: Diagnosis | None = None
        self._count = 0

    def on_step(self, step: int, values: Mapping) -> Values | None:
        if self.staleness_bound is not None:
            values = {**values, "staleness_bound": {(): self.staleness_bound}}
        self.window.append(values)
        self._count += 1
        if self._count % self.every and self.latest is not None:
            return None
        self.latest = diagnose(self.window)
        return {"diagnosis_info": {(self.latest.cause, self.latest.confidence): 1.0}}

    def close(self) -> None:
        pass
