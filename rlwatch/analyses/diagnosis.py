"""Name the likely cause of a sampler-learner mismatch from its signature, with the evidence.

The per-token log-ratios r = log pi_old - log mu carry a fingerprint of what made them, read here
from the step values the signals export (live or from a run store):

- the mismatch at each version lag (``mismatch_abs_log_ratio_mean_by_lag{lag}``): its level at lag 0
  is the numerics/semantics floor (``numeric_noise``: the sampler computes the same policy with other
  numerics), its growth with lag is staleness (``stale_weights``);
- ``weight_sync_missing``: the maximum lag keeps growing by about one per trainer update;
- ``temperature_mismatch``: r is linear in the sampler log-prob (slope near T_s/T_t - 1);
- ``top_p_truncation``: a one-signed offset (r <= 0: the sampler renormalised over the kept mass)
  with a flat slope, often with -inf sampler log-probs (excluded tokens that were sampled anyway);
- ``none``: the mismatch is below the floor where any cause could be told.

Numeric noise and staleness together name both, the larger contribution to the mean |log-ratio|
first. Every threshold and the confidence of each verdict come from the labelled evaluation's
tuning split (:mod:`rlwatch.analyses.diagnosis_tuned`, written by ``python -m evaluation.diagnosis_eval
--tune``). :func:`diagnose` reads a window of steps; :class:`Diagnoser` is the ``Watch`` listener
that exports ``rlwatch_diagnosis_info``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .diagnosis_tuned import CALIBRATION, THRESHOLDS
from ..core.values import Values, value_of as _get

#: Edges of the margin bins the confidence is calibrated on (decades between a feature and its threshold).
MARGIN_BINS = (0.25, 0.75)


@dataclass
class Diagnosis:
    """``causes``: the named causes, the largest first (``["none"]`` when there is none);
    ``confidence``: the tuning split's accuracy on verdicts of this kind and margin, as a label;
    ``accuracy``: that accuracy (None where no tuning verdict was alike)."""

    causes: list[str]
    confidence: str                       # "low" | "medium" | "high"
    evidence: list[str] = field(default_factory=list)
    features: dict[str, float] = field(default_factory=dict)
    margin: float = 0.0                   # decades between the deciding feature and its threshold
    accuracy: float | None = None

    @property
    def cause(self) -> str:
        return self.causes[0]

    @property
    def name(self) -> str:
        """The causes as one string, the largest first (``"stale_weights + numeric_noise"``)."""
        return " + ".join(self.causes)

    def as_dict(self) -> dict:
        return {"cause": self.cause, "causes": self.causes, "confidence": self.confidence,
                "accuracy": self.accuracy, "evidence": self.evidence,
                "features": {k: v for k, v in self.features.items()
                             if isinstance(v, (int, float)) and math.isfinite(v)}}


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


#: Every signal :func:`diagnose` reads from a step (a long run's post-mortem keeps only what it reads).
INPUTS = ("mismatch_tokens_by_lag", "mismatch_abs_log_ratio_mean_by_lag", "mismatch_abs_log_ratio_mean",
          "mismatch_log_ratio_mean", "mismatch_log_ratio_slope", "tokens", "nonfinite_tokens",
          "mismatch_abs_log_ratio_by_prob", "trainer_version", "version_lag_max", "version_lag_mean",
          "staleness_bound")


def _lag_of(label: str) -> float:
    """A lag bucket's label as its upper bound in updates (``+Inf`` past the last bound)."""
    return math.inf if label == "+Inf" else float(label)


def by_lag(steps: list[Mapping]) -> dict[str, tuple[float, float]]:
    """Per lag bucket over the window: (tokens, token-weighted mean |log-ratio| in nats)."""
    sums: dict[str, list[float]] = {}
    for s in steps:
        for (label,), n in (s.get("mismatch_tokens_by_lag") or {}).items():
            level = _get(s, "mismatch_abs_log_ratio_mean_by_lag", (label,))
            if n and level is not None and math.isfinite(level):
                acc = sums.setdefault(label, [0.0, 0.0])
                acc[0] += n
                acc[1] += n * level
    return {label: (n, total / n) for label, (n, total) in sorted(sums.items(), key=lambda kv: _lag_of(kv[0]))}


def _lag_features(steps: list[Mapping]) -> dict[str, float | None]:
    """The floor (lag-0 level), the staleness excess above it and the share of stale tokens."""
    buckets = by_lag(steps)
    tokens = sum(n for n, _ in buckets.values())
    if not tokens:
        return {"lag_tokens": 0.0, "floor": None, "stale_excess": None, "stale_share": None}
    floor = buckets["0"][1] if "0" in buckets else None
    stale = [(n, level) for label, (n, level) in buckets.items() if label != "0"]
    stale_tokens = sum(n for n, _ in stale)
    excess = (sum(n * max(0.0, level - (floor or 0.0)) for n, level in stale) / stale_tokens
              if stale_tokens else None)
    return {"lag_tokens": tokens, "floor": floor, "stale_excess": excess, "stale_share": stale_tokens / tokens,
            "floor_tokens": buckets["0"][0] if "0" in buckets else 0.0}


def features(steps: Iterable[Mapping], staleness_bound: float | None = None) -> dict[str, float | None]:
    """Summary features of a window of steps (each one step's values, live or stored)."""
    steps = list(steps)
    rows = [s for s in steps if _get(s, "mismatch_abs_log_ratio_mean") is not None]
    signed = [_get(s, "mismatch_log_ratio_mean") for s in rows]
    slopes = sorted(v for s in rows if (v := _get(s, "mismatch_log_ratio_slope")) is not None)
    tokens = sum(_get(s, "tokens") or 0.0 for s in steps)
    nonfinite = sum(_get(s, "nonfinite_tokens") or 0.0 for s in steps)
    low = [v for s in rows if (v := _get(s, "mismatch_abs_log_ratio_by_prob", ("0.0-0.1",))) is not None]
    high = [v for s in rows if (v := _get(s, "mismatch_abs_log_ratio_by_prob", ("0.9-1.0",))) is not None]
    versions = [(v, m) for s in steps if (v := _get(s, "trainer_version")) is not None
                and (m := _get(s, "version_lag_max")) is not None]
    late = versions[-max(3, len(versions) // 3):]
    return {
        "steps": float(len(rows)),
        "abs_mean": _mean([_get(s, "mismatch_abs_log_ratio_mean") for s in rows]),
        "signed_mean": _mean([v for v in signed if v is not None]),
        "slope": slopes[len(slopes) // 2] if slopes else None,
        "nonfinite_fraction": nonfinite / tokens if tokens else None,
        "lag_mean": _mean([v for s in rows if (v := _get(s, "version_lag_mean")) is not None]),
        "lag_max": max((m for _, m in versions), default=None),
        "late_lag_growth": _slope([v for v, _ in late], [m for _, m in late]),
        "low_prob_abs": _mean(low),
        "high_prob_abs": _mean(high),
        "staleness_bound": staleness_bound if staleness_bound is not None else next(
            (b for s in reversed(steps) if (b := _get(s, "staleness_bound")) is not None), None),
        **_lag_features(steps),
    }


def _decades(value: float, threshold: float) -> float:
    """How many decades ``value`` lies from ``threshold`` (either side)."""
    return abs(math.log10(max(value, 1e-300) / threshold)) if threshold > 0 else math.inf


def decide(f: Mapping[str, float | None], t: Mapping[str, float] = THRESHOLDS) -> tuple[list[str], float]:
    """The causes (largest first) and the margin of the verdict, from :func:`features` and thresholds."""
    abs_mean = f["abs_mean"]
    if abs_mean is None:
        return ["none"], 0.0
    growth, lag_max = f["late_lag_growth"], f["lag_max"] or 0.0
    bound = f["staleness_bound"] or t["sync_lag_min"] / 2
    if growth is not None and growth > t["sync_growth"] and lag_max > max(t["sync_lag_min"], 2 * bound):
        return ["weight_sync_missing"], _decades(growth, t["sync_growth"])
    if abs_mean < t["floor"]:
        return ["none"], _decades(abs_mean, t["floor"])
    slope, signed, lag_mean = f["slope"], f["signed_mean"] or 0.0, f["lag_mean"] or 0.0
    floor, excess, share = f["floor"], f["stale_excess"], f["stale_share"]
    # Staleness also tilts and offsets the log-ratio: the semantics faults are told where it is absent.
    stale = excess > t["stale_excess"] if excess is not None else not f["lag_tokens"] and lag_mean >= 0.5
    if not stale and slope is not None and abs(slope) > t["temperature_slope"]:
        return ["temperature_mismatch"], _decades(abs(slope), t["temperature_slope"])
    one_signed = -signed / abs_mean
    if not stale and one_signed > t["top_p_one_signed"] and (slope is None or abs(slope) <= t["temperature_slope"]):
        return ["top_p_truncation"], _decades(one_signed, t["top_p_one_signed"])
    if f["lag_tokens"]:
        parts = []
        if floor is not None and floor > t["floor"]:
            parts.append(("numeric_noise", floor, _decades(floor, t["floor"])))
        if excess is not None and excess > t["stale_excess"]:
            parts.append(("stale_weights", excess * share, _decades(excess, t["stale_excess"])))
        if parts:
            parts.sort(key=lambda p: -p[1])
            return [p[0] for p in parts], min(p[2] for p in parts)
        return ["none"], _decades(max(floor or 0.0, excess or 0.0), t["floor"])
    # No per-lag split (a run without versions, or stored before the per-lag signal): the mean lag decides.
    if lag_mean >= 0.5:
        return ["stale_weights"], _decades(abs_mean, t["floor"])
    return ["numeric_noise"], _decades(abs_mean, t["floor"])


def confidence(causes: list[str], margin: float) -> tuple[str, float | None]:
    """The tuning split's accuracy on verdicts naming ``causes`` within the same margin bin, as a label."""
    bin_index = sum(margin >= edge for edge in MARGIN_BINS)
    accuracy = CALIBRATION.get(" + ".join(sorted(causes)), {}).get(bin_index)
    if accuracy is None:
        return "low", None
    return ("high" if accuracy >= 0.9 else "medium" if accuracy >= 0.7 else "low"), accuracy


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _evidence(causes: list[str], f: Mapping[str, float | None], steps: list[Mapping],
              t: Mapping[str, float]) -> list[str]:
    """Lines that support ``causes`` (each is stated only where its own condition holds)."""
    lines: list[str] = []
    abs_mean, signed = f["abs_mean"], f["signed_mean"] or 0.0
    if abs_mean is None:
        return ["no step carried both sampler and trainer log-probs"]
    buckets = by_lag(steps)
    levels = ", ".join(f"{_g(level)} at lag {'<= ' if label not in ('0', '1', '2', '3', '4') else ''}{label}"
                       for label, (_, level) in list(buckets.items())[:6])
    cause = causes[0]
    if cause == "none":
        return [f"mean |log-ratio| {abs_mean:.2e} nats, below the floor {t['floor']:.1e} where a cause can be told"
                + (f" ({levels})" if levels else "")]
    if cause == "weight_sync_missing":
        return [f"maximum version lag grows {f['late_lag_growth']:.2f} per trainer update to the end of the window "
                f"and reached {f['lag_max']:.0f}", "the sampler keeps generating with weights that are never replaced"]
    if cause == "temperature_mismatch":
        return [f"log-ratio is linear in the sampler log-prob: slope {f['slope']:+.3f} (a sampler temperature T_s "
                f"against the trainer's T_t gives roughly T_s/T_t - 1)",
                f"mean signed log-ratio {signed:+.4f} nats at mean lag {f['lag_mean'] or 0:.2f}"]
    if cause == "top_p_truncation":
        lines = [f"constant offset: mean signed log-ratio {signed:+.4f} nats is {-signed / abs_mean:.0%} of the "
                 f"mean |log-ratio| (log of the kept probability mass), flat in the sampler log-prob"]
        if f["nonfinite_fraction"]:
            lines.append(f"{f['nonfinite_fraction']:.2%} of tokens have a -inf or NaN log-prob (sampled outside "
                         "the kept set)")
        return lines
    for c in causes:
        if c == "stale_weights":
            lines.append(f"mismatch grows with the version lag: mean |log-ratio| {levels} (nats)"
                         if f["floor"] is not None else
                         f"mean |log-ratio| {levels} (nats); no lag-0 token to measure the numerics floor on")
            lines.append(f"{f['stale_share']:.0%} of the tokens came from an older policy (mean lag "
                         f"{f['lag_mean'] or 0:.2f}, max {f['lag_max'] or 0:.0f})")
        elif f["lag_tokens"]:
            lines.append(f"mismatch at lag 0 (same weights): {f['floor']:.2e} nats mean |log-ratio| over "
                         f"{f['floor_tokens']:.0f} tokens, the numerics floor")
        else:
            lines.append(f"mean |log-ratio| {abs_mean:.2e} nats with no version information (no per-lag split)")
    if "numeric_noise" in causes and abs(signed) < 0.2 * abs_mean:
        lines.append(f"zero-mean: signed mean {signed:+.2e} against mean |log-ratio| {abs_mean:.2e} nats")
    low, high = f["low_prob_abs"], f["high_prob_abs"]
    if "numeric_noise" in causes and low is not None and high is not None and low > 2 * high:
        lines.append(f"concentrated on low-probability tokens: {low:.3g} nats below p=0.1 against {high:.3g} "
                     f"above p=0.9")
    return lines


def diagnose(steps: Iterable[Mapping], staleness_bound: float | None = None,
             thresholds: Mapping[str, float] = THRESHOLDS) -> Diagnosis:
    """The most likely cause(s) over a window of steps, with the evidence for them."""
    steps = list(steps)
    f = features(steps, staleness_bound)
    causes, margin = decide(f, thresholds)
    label, accuracy = confidence(causes, margin)
    return Diagnosis(causes, label, _evidence(causes, f, steps, thresholds), dict(f), margin, accuracy)


class Diagnoser:
    """A ``Watch`` listener: diagnoses over the last ``window`` steps every ``every`` steps and exports
    ``rlwatch_diagnosis_info{cause, confidence}`` (the largest cause)."""

    def __init__(self, window: int = 30, every: int = 5, staleness_bound: float | None = None) -> None:
        self.window: deque = deque(maxlen=window)
        self.staleness_bound = staleness_bound
        self.every = every
        self.latest: Diagnosis | None = None
        self._count = 0

    def on_step(self, step: int, values: Mapping) -> Values | None:
        self.window.append(values)
        self._count += 1
        if self._count % self.every and self.latest is not None:
            return None
        self.latest = diagnose(self.window, self.staleness_bound)
        return {"diagnosis_info": {(self.latest.cause, self.latest.confidence): 1.0}}

    def close(self) -> None:
        pass
