"""k3 against the run's own baseline, and the steps left to the critical bound at its current trend.

The run baseline is the lowest 20-step median of k3 the run has shown (after ``baseline_steps``
steps): it follows a run whose mismatch settles lower, never one that climbs, so a slow climb is
measured against where the run started. Where the trainer logs its learning rate, k3 is read per unit
of the squared learning rate's running maximum (:func:`run_baseline`): a warm-up's rise is not a departure.
It persists across steps in :class:`History`'s memory (the step windows keep only the last 130 steps).

The forecast fits ln k3 = a + b t over the last :data:`TREND_STEPS` steps by least squares; when the
slope is positive by ``evidence_z`` standard errors and the fitted level, the latest k3 and its
5-step median are all below ``kl_k3_max`` (a bound already passed is never forecast), the steps
left are (ln kl_k3_max - fitted level now) / b, kept when at most :data:`FORECAST_MAX_STEPS`.
No trend (flat, falling, or not distinguishable from noise): no forecast.
"""

from __future__ import annotations

import math
import statistics

from .history import History

K3 = "mismatch_kl_k3"
#: The learning rate the trainer logs (rlwatch.core.trainer_keys).
LR = "learning_rate"
#: Steps of the rolling median whose lowest value is the run baseline.
MEDIAN_STEPS = 20
#: Steps of the median the baseline conditions compare (isolated spikes do not count).
SMOOTH_STEPS = 5
#: Steps of the log-linear fit behind the forecast.
TREND_STEPS = 40
#: Longer forecasts are left out (a healthy drift that would reach the bound in years).
FORECAST_MAX_STEPS = 2000.0


def run_baseline(h: History) -> float | None:
    """The run's k3 baseline (nats) at the current step, updated once per step; None before
    ``baseline_steps`` steps.

    Where the trainer logs its learning rate, k3 is read per unit of the squared learning rate's running
    maximum (the update size squared, which a warm-up raises): the baseline is the lowest 20-step median
    of k3 / lr_max^2, scaled back by the current lr_max^2, so a warm-up's rise is no departure and a decay
    (lr_max unchanged) is read as before. Without a logged learning rate, the lowest 20-step median of k3."""
    memory = h.memory.setdefault(K3, {"step": None, "baseline": None, "seen": 0, "lr_max": 0.0, "scaled": []})
    if memory["step"] != h.step:
        memory["step"] = h.step
        memory["lr_max"] = max(memory["lr_max"], h.latest(LR) or 0.0)
        k3 = h.latest(K3)
        if k3 is not None:
            memory["seen"] += 1
            memory["scaled"] = (memory["scaled"] + [k3 / _scale(memory)])[-MEDIAN_STEPS:]
        recent = memory["scaled"]
        if memory["seen"] >= max(MEDIAN_STEPS, h.p("baseline_steps")) and len(recent) >= MEDIAN_STEPS // 2:
            level = statistics.median(recent)
            if level > 0 and (memory["baseline"] is None or level < memory["baseline"]):
                memory["baseline"] = level
    baseline = memory["baseline"] * _scale(memory) if memory["baseline"] is not None else None
    if baseline is not None:
        h.stats[("run_baseline", K3)] = baseline
        smooth = smoothed(h)
        if smooth is not None:
            h.stats[("baseline_ratio", K3)] = smooth / baseline
    return baseline


def _scale(memory: dict) -> float:
    """The squared running maximum of the learning rate (1 while none is logged)."""
    return memory["lr_max"] ** 2 if memory["lr_max"] > 0 else 1.0


def smoothed(h: History, signal: str = K3) -> float | None:
    """Median of ``signal`` (k3 by default) over the last :data:`SMOOTH_STEPS` steps."""
    recent = h.window(signal, (), last=SMOOTH_STEPS)
    return statistics.median(recent) if recent else None


def forecast_steps(h: History, bound: float, signal: str = K3) -> float | None:
    """Steps until ``signal`` (k3 by default) reaches ``bound`` at its log-linear trend over the last
    :data:`TREND_STEPS` steps; None without a significant upward trend, with the fitted level, the
    latest value or its 5-step median at or above the bound, or beyond FORECAST_MAX_STEPS."""
    points = [(t, math.log(v)) for t, values in h.steps[-TREND_STEPS:]
              if (v := values.get(signal, {}).get(())) is not None and v == v and v > 0]
    if len(points) < TREND_STEPS // 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in points)
    if sxx <= 0:
        return None
    slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / sxx
    residual = sum((y - mean_y - slope * (t - mean_t)) ** 2 for t, y in points) / max(1, n - 2)
    stderr = math.sqrt(residual / sxx)
    now = mean_y + slope * (points[-1][0] - mean_t)
    if slope <= 0 or slope - h.p("evidence_z") * stderr <= 0 or now >= math.log(bound):
        return None
    latest, recent = h.latest(signal), smoothed(h, signal)
    if any(v is not None and v >= bound for v in (latest, recent)):
        return None                                   # already passed: nothing left to forecast
    steps = (math.log(bound) - now) / slope
    return steps if steps <= FORECAST_MAX_STEPS else None


def k3_trend(h: History) -> None:
    """Export the run baseline, k3's ratio to it and the forecast to ``kl_k3_max`` (window stats)."""
    run_baseline(h)
    steps = forecast_steps(h, h.p("kl_k3_max"))
    if steps is not None:
        h.stats[("forecast_steps", K3)] = steps


__all__ = ["FORECAST_MAX_STEPS", "K3", "LR", "forecast_steps", "k3_trend", "run_baseline", "smoothed"]
