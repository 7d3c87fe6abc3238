"""What ``rlwatch whatif`` reads from a run: its episode durations, batch size, training and sync
seconds, measured throughput and staleness, and its mismatch by version lag.

The names are the run store's catalogue keys (docs/rollout-system.md): the per-episode duration
samples ``episode_duration_sample_seconds{outcome, env, index}``, ``phase_seconds{phase}``,
``weight_sync_seconds``, ``sequences``, ``step_interval_seconds``, ``episodes_launched_total``,
``version_lag_mean`` / ``_max``, ``staleness_bound`` (or the run's metadata ``config``),
``partial_rollout_ratio``, ``alert_threshold{param="kl_k3_max"}`` and
``mismatch_kl_k3_by_lag{lag}`` with ``mismatch_tokens_by_lag{lag}``. A run is read with the
post-mortem's loader, so RUN is anything ``rlwatch postmortem`` reads (a store, a TRL or verl
output directory) and ``run`` picks the run in a store of several.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..core.metrics import LAG_BUCKET_LABELS, LAG_BUCKETS
from ..postmortem.sources import RunData, load_path

DURATION_SAMPLES = "episode_duration_sample_seconds"
TRAINED = "trained"


@dataclass
class LagCost:
    """The run's token-weighted k3 per version-lag bucket: ``points`` maps a representative lag
    (the bucket's middle integer lag) to (k3, tokens); the +Inf bucket is left out."""

    points: dict[float, tuple[float, float]] = field(default_factory=dict)
    overall: float | None = None          # token-weighted k3 over every bucket, +Inf included

    @property
    def slope(self) -> float | None:
        """k3 per extra version of lag: the least-squares slope over the buckets (unweighted, so
        the lag-0 bulk does not drown the stale tail); None with fewer than two lags."""
        if len(self.points) < 2:
            return None
        lags = list(self.points)
        k3 = [self.points[lag][0] for lag in lags]
        mean_lag, mean_k3 = statistics.fmean(lags), statistics.fmean(k3)
        spread = sum((x - mean_lag) ** 2 for x in lags)
        return sum((x - mean_lag) * (y - mean_k3) for x, y in zip(lags, k3)) / spread

    def at(self, lag: float) -> tuple[float, bool] | None:
        """Predicted k3 at ``lag`` and whether it is extrapolated: linear between the measured
        lags, the slope beyond them (floored at the nearest measured value); None without data."""
        if not self.points:
            return None
        lags = sorted(self.points)
        if len(lags) == 1:
            return self.points[lags[0]][0], lag != lags[0]
        for lo, hi in zip(lags, lags[1:]):
            if lo <= lag <= hi:
                k_lo, k_hi = self.points[lo][0], self.points[hi][0]
                return k_lo + (k_hi - k_lo) * (lag - lo) / (hi - lo), False
        edge = lags[0] if lag < lags[0] else lags[-1]
        slope = self.slope or 0.0
        return max(0.0, self.points[edge][0] + slope * (lag - edge)), True


@dataclass
class Measured:
    """A run's measured inputs (durations in seconds) and outcomes; None where it lacks the signal."""

    run: str
    source: str
    steps: int
    launched_durations: list[float]           # trained and dropped episodes' durations (samples)
    trained_durations: list[float]
    batch_size: int | None                    # median episodes per step
    train_s: float | None                     # median training seconds per step
    sync_s: float | None                      # median weight-sync seconds per step
    generation_s: float | None
    throughput: float | None                  # trained episodes per hour
    busy_s: float | None                      # episode-seconds run over the timed steps
    wall_s: float | None                      # wall seconds of the timed steps
    staleness_mean: float | None              # per-token version lag, mean over steps
    staleness_max: float | None
    staleness_bound: float | None
    partial: bool | None                      # some sequence spanned versions
    lag_cost: LagCost
    k3_bound: float | None                    # the run's kl_k3_max threshold, when stored
    envs: list[str] = field(default_factory=list)   # environments with durations (all of the run's)
    env: str | None = None                    # the one whose durations were taken, if chosen
    unphased_s: float | None = None           # median seconds of a step outside every recorded phase
    interval_s: float | None = None           # median wall seconds between steps

    def utilisation(self, slots: int) -> float | None:
        """Busy share of ``slots`` over the timed steps (an estimate: the run does not record slots)."""
        if not self.busy_s or not self.wall_s:
            return None
        return self.busy_s / (slots * self.wall_s)


def _median(series: list[tuple[int, float]]) -> float | None:
    return statistics.median(v for _, v in series) if series else None


def _durations(data: RunData, env: str | None) -> tuple[list[float], list[float], dict[int, float], set[str]]:
    """(launched, trained, step -> mean launched duration, every environment with a duration) from
    the per-episode samples (``env``: that environment's only)."""
    launched: list[float] = []
    trained: list[float] = []
    step_mean: dict[int, float] = {}
    envs: set[str] = set()
    for step, values in data.steps:
        rows = values.get(DURATION_SAMPLES, {})
        here = []
        for labels, seconds in rows.items():
            if seconds is None or not 0 <= seconds < math.inf or len(labels) < 2:
                continue
            envs.add(str(labels[1]))
            if env is not None and labels[1] != env:
                continue
            here.append(seconds)
            if labels[0] == TRAINED:
                trained.append(seconds)
        if here:
            launched += here
            step_mean[step] = statistics.fmean(here)
    return launched, trained, step_mean, envs


def _lag_cost(data: RunData) -> LagCost:
    sums: dict[str, list[float]] = {}
    for _, values in data.steps:
        k3 = values.get("mismatch_kl_k3_by_lag", {})
        tokens = values.get("mismatch_tokens_by_lag", {})
        for labels, value in k3.items():
            n = tokens.get(labels)
            if value is None or not n:
                continue
            acc = sums.setdefault(labels[0], [0.0, 0.0])
            acc[0] += value * n
            acc[1] += n
    tokens = sum(n for _, n in sums.values())
    cost = LagCost(overall=sum(k for k, _ in sums.values()) / tokens if tokens else None)
    for i, label in enumerate(LAG_BUCKET_LABELS[:-1]):           # +Inf: no lag to place it at
        if label in sums and sums[label][1] > 0:
            low = LAG_BUCKETS[i - 1] + 1 if i else 0
            cost.points[(low + LAG_BUCKETS[i]) / 2] = (sums[label][0] / sums[label][1], sums[label][1])
    return cost


def _timed(data: RunData, step_mean: dict[int, float]) -> tuple[float | None, float | None, float | None]:
    """(trained episodes per hour, busy episode-seconds, wall seconds) over the steps with an interval;
    a step's busy seconds: its mean sampled duration times the episodes it launched (else trained)."""
    intervals = dict(data.series("step_interval_seconds"))
    sizes = dict(data.series("sequences"))
    launched = _summed_by_step(data, "episodes_launched_total")
    steps = [s for s in intervals if s in sizes and intervals[s] > 0]
    if not steps:
        return None, None, None
    wall = sum(intervals[s] for s in steps)
    throughput = sum(sizes[s] for s in steps) / wall * 3600.0
    busy_steps = [s for s in steps if s in step_mean]
    if not busy_steps:
        return throughput, None, None
    busy = sum(step_mean[s] * launched.get(s, sizes[s]) for s in busy_steps)
    return throughput, busy, sum(intervals[s] for s in busy_steps)


def _unphased(data: RunData) -> float | None:
    """Median over steps of the wall time between steps minus the step's recorded phases (seconds)."""
    intervals = dict(data.series("step_interval_seconds"))
    phased = _summed_by_step(data, "phase_seconds")
    rest = [(s, intervals[s] - phased[s]) for s in intervals if s in phased]
    return _median(rest)


def _summed_by_step(data: RunData, name: str) -> dict[int, float]:
    """A labelled counter's step increments summed over its label sets."""
    out: dict[int, float] = {}
    for step, values in data.steps:
        rows = [v for v in values.get(name, {}).values() if v is not None]
        if rows:
            out[step] = sum(rows)
    return out


def measure(data: RunData, env: str | None = None) -> Measured:
    """The run's inputs and outcomes (``env``: only that environment's durations)."""
    launched, trained, step_mean, envs = _durations(data, env)
    throughput, busy, wall = _timed(data, step_mean)
    sizes = _median(data.series("sequences"))
    sync = _median(data.series("phase_seconds", ("sync",)))
    if sync is None:
        sync = _median(data.series("weight_sync_seconds"))
    lag_means = [v for _, v in data.series("version_lag_mean")]
    lag_max = [v for _, v in data.series("version_lag_max")]
    spans = [v for _, v in data.series("partial_rollout_ratio")]
    bound = [v for _, v in data.series("staleness_bound")]
    config = data.meta.get("config") if isinstance(data.meta, dict) else None
    if not bound and isinstance(config, dict) and isinstance(config.get("staleness_bound"), (int, float)):
        bound = [float(config["staleness_bound"])]          # the Watch's option, in the run's metadata
    threshold = data.series("alert_threshold", ("kl_k3_max",))
    return Measured(
        run=data.run, source=data.source, steps=len(data.steps), launched_durations=launched,
        trained_durations=trained, batch_size=round(sizes) if sizes else None,
        train_s=_median(data.series("phase_seconds", ("training",))), sync_s=sync,
        generation_s=_median(data.series("phase_seconds", ("generation",))),
        throughput=throughput, busy_s=busy, wall_s=wall,
        staleness_mean=statistics.fmean(lag_means) if lag_means else None,
        staleness_max=max(lag_max) if lag_max else None,
        staleness_bound=bound[-1] if bound else None, partial=any(v > 0 for v in spans) if spans else None,
        lag_cost=_lag_cost(data), k3_bound=threshold[-1][1] if threshold else None,
        envs=sorted(envs), env=env, unphased_s=_unphased(data),
        interval_s=_median(data.series("step_interval_seconds")))


def load(path: str, run: str | None = None, env: str | None = None) -> Measured:
    """Read ``run`` of ``path`` (anything ``rlwatch postmortem`` reads)."""
    return measure(load_path(path, run), env)


def describe(measured: Measured) -> dict[str, Any]:
    """The measured figures as plain numbers (JSON)."""
    return {"run": measured.run, "source": measured.source, "steps": measured.steps,
            "episodes_with_duration": len(measured.launched_durations),
            "trained_duration_mean_s": statistics.fmean(measured.trained_durations)
            if measured.trained_durations else None,
            "batch_size": measured.batch_size, "train_s": measured.train_s, "sync_s": measured.sync_s,
            "generation_s": measured.generation_s, "throughput_episodes_per_hour": measured.throughput,
            "staleness_mean": measured.staleness_mean, "staleness_max": measured.staleness_max,
            "staleness_bound": measured.staleness_bound, "partial_rollouts": measured.partial,
            "k3_by_lag": {str(lag): {"k3": k3, "tokens": n} for lag, (k3, n) in measured.lag_cost.points.items()},
            "k3_per_version": measured.lag_cost.slope, "k3_overall": measured.lag_cost.overall}
