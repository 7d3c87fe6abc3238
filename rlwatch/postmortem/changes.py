"""Change detection for the post-mortem: which signals are scanned, and when each one changed.

Change detection: a two-sided CUSUM (Page, 1954) per signal over the whole run.

    z_t = (x_t - mu_0) / sigma
    S+_t = max(0, S+_{t-1} + z_t - k),   S-_t = max(0, S-_{t-1} - z_t - k)

An alarm is raised when ``S+`` or ``S-`` exceeds ``h``; the change is dated at the first step of
the excursion that led to the alarm (the step after the statistic was last zero, the standard
CUSUM change-time estimate), so a ramp that starts at step 0 is dated at its start, not after a
fixed baseline window. The reference ``mu_0`` is the median of the first :data:`REFERENCE_POINTS`
values (a single run) or 0 (the difference between two runs that should agree). The noise scale
``sigma`` is robust to the changes themselves: 1.4826 * MAD of the first differences / sqrt(2)
(a level shift or a ramp moves few first differences, or moves them all alike; a trimmed mean
of the absolute differences where that MAD is 0, for series that are constant on most steps:
:func:`robust_noise`), floored at the
signal's smallest meaningful shift (:data:`LEADING_SIGNALS`), so a signal that sits at exactly 0
(sigma 0) does not count one group in 32 as a departure. An alarm is kept only when the level
after the change (median from the alarm to ``CONFIRM_STEPS`` steps past it) differs from
``mu_0`` by at least ``confirm`` noise units (checked again at every step while the statistic is
above ``h``): a brief excursion of a noisy signal is not a change.

CUSUM over Page-Hinkley or a Bayesian online change point: the same test (Page-Hinkley is the
CUSUM with a running mean), with two interpretable constants (k: half the smallest shift, in
noise units, worth detecting; h: evidence needed) and an explicit change-time estimate.
"""


from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from .sources import RunData


@dataclass(frozen=True)
class SignalSpec:
    """How to read a signal in a post-mortem: its trouble direction and smallest meaningful shift."""

    trouble: str          # "up" | "down" | "either": which way a move means trouble
    min_shift: float      # in the signal's unit; the noise floor of the change test
    unit: str = ""
    relative: float = 0.0  # and at least this fraction of the series' largest |value| (signals of no fixed scale)
    compared: bool = True  # compared between runs (wall-clock timings differ between any two runs: not)

    def floor(self, values: list[float]) -> float:
        """The smallest meaningful shift for this series."""
        scale = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
        return max(self.min_shift, self.relative * scale)


# Signals scanned for changes, with the direction that means trouble and the smallest shift worth
# reporting (ratios: 5 points of the share; lag: one update; KL/log-ratios in nats).
LEADING_SIGNALS: dict[str, SignalSpec] = {
    "version_lag_max": SignalSpec("up", 1.0, "updates"),
    "version_lag_mean": SignalSpec("up", 0.25, "updates"),
    "mismatch_kl_k3": SignalSpec("up", 1e-3, "nats"),
    "mismatch_abs_log_ratio_mean": SignalSpec("up", 0.01, "nats"),
    "mismatch_abs_log_ratio_p99": SignalSpec("up", 0.1, "nats"),
    "is_ess_ratio": SignalSpec("down", 0.05),
    "is_tis_high_ratio": SignalSpec("up", 0.05),
    "is_tis_low_ratio": SignalSpec("up", 0.05),
    "entropy_mean": SignalSpec("either", 0.05, "nats"),  # a fall: RLWatchEntropyCollapse; a rise: ...Surge
    "zero_variance_groups_ratio": SignalSpec("up", 0.05),
    "truncated_ratio": SignalSpec("up", 0.05),
    "env_hack_ratio": SignalSpec("up", 0.05),
    "reward_mean": SignalSpec("down", 0.05, relative=0.1),
    "response_length_mean": SignalSpec("either", 0.5, "tokens", relative=0.1),
    # The trainer's own dynamics (docs/trainer-dynamics.md): the update's size, the gradient, the clip.
    "policy_kl": SignalSpec("up", 1e-3, "nats", relative=0.1),
    "grad_norm": SignalSpec("up", 0.0, relative=0.2),
    "clip_fraction": SignalSpec("up", 0.05),
    # The rollout system (docs/rollout-system.md): the duration tail, the straggler wait, the sync pause.
    "episode_duration_p95_seconds": SignalSpec("up", 0.0, "s", relative=0.2, compared=False),
    "straggler_wait_seconds": SignalSpec("up", 0.0, "s", relative=0.2, compared=False),
    "weight_sync_seconds": SignalSpec("up", 0.0, "s", relative=0.2, compared=False),
    "length_bias_duration_ratio": SignalSpec("down", 0.05),
}
QUALITY_SPEC = SignalSpec("down", 0.05, relative=0.1)

# Detector constants, tuned on the demo's healthy seeds 0-2 and collapse seed 0 (README: Post-mortem);
# tested on healthy seeds 3-4, collapse seeds 1-4 and synthetic runs (tests/test_postmortem*.py).
REFERENCE_POINTS = 3       # mu_0 of a single run: median of its first values
CUSUM_K = 0.5              # allowance, noise units: shifts under ~2k * sigma are not chased
CUSUM_H = 5.0              # decision interval, noise units
CONFIRM = 2.0              # single run: |level after - mu_0| >= CONFIRM * sigma
CONFIRM_STEPS = 5          # the level after a change: median from the alarm to this many steps past it
COMPARE_H = 8.0            # two runs: more evidence, as two runs of one config wander apart for a while
COMPARE_CONFIRM = 2.5


def _label_name(signal: str, labels: tuple[str, ...]) -> str:
    shown = [label for label in labels if label]
    return signal + (f"{{{','.join(shown)}}}" if shown else "")


def robust_noise(values: list[float], trim: float = 0.1) -> float:
    """Step-to-step noise of a series (the standard deviation of white noise around a level that
    shifts or ramps), robust to the shifts themselves: 1.4826 * MAD of the first differences /
    sqrt(2). When more than half the differences are equal (the MAD is 0: a share of groups that
    is 0 on most steps and jumps by one group on others, a lag that ramps then holds), it is
    sqrt(pi)/2 * the mean absolute first difference once its largest ``trim`` share is dropped."""
    diffs = [b - a for a, b in zip(values, values[1:])]
    if len(diffs) < 2:
        return 0.0
    centre = statistics.median(diffs)
    mad = 1.4826 * statistics.median(abs(d - centre) for d in diffs) / math.sqrt(2)
    if mad > 0:
        return mad
    absolute = sorted(abs(d - centre) for d in diffs)
    kept = absolute[:max(1, len(absolute) - int(trim * len(absolute)))]
    return math.sqrt(math.pi) / 2 * sum(kept) / len(kept)


@dataclass
class Change:
    """The first change of one signal: dated at ``step`` (start of the excursion), confirmed at ``alarm_step``."""

    signal: str
    labels: tuple[str, ...]
    step: int
    alarm_step: int
    before: float           # mu_0: the reference level
    after: float            # the level after the change
    noise: float            # sigma used by the test (robust noise, floored)
    trouble: str = "either"
    lead: int | None = None  # collapse step - step (negative: after the collapse)

    @property
    def name(self) -> str:
        return _label_name(self.signal, self.labels)

    @property
    def size(self) -> float:
        """(after - before) in noise units."""
        return (self.after - self.before) / self.noise if self.noise > 0 else math.inf

    @property
    def direction(self) -> str:
        return "up" if self.after > self.before else "down"

    @property
    def concerning(self) -> bool:
        return self.trouble == "either" or self.trouble == self.direction

    def as_json(self) -> dict[str, Any]:
        return {"signal": self.name, "name": self.signal, "labels": list(self.labels), "step": self.step,
                "alarm_step": self.alarm_step, "lead": self.lead, "baseline": _clean_zero(self.before),
                "value": _clean_zero(self.after), "noise": self.noise, "size": _finite(self.size),
                "direction": self.direction, "concerning": self.concerning}


def _clean_zero(x: float) -> float:
    return 0.0 if x == 0 else x


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def detect_change(points: list[tuple[int, float]], min_shift: float, reference: float | None = None,
                  k: float = CUSUM_K, h: float = CUSUM_H, confirm: float = CONFIRM
                  ) -> tuple[int, int, float, float, float] | None:
    """Two-sided CUSUM over ``points`` (step, value), sorted by step.

    Returns (change step, alarm step, mu_0, level after, sigma) for the first confirmed change,
    or None. ``reference`` fixes mu_0 (else the median of the first REFERENCE_POINTS values).
    """
    values = [v for _, v in points if math.isfinite(v)]
    steps = [s for s, v in points if math.isfinite(v)]
    if len(values) < REFERENCE_POINTS + 2:
        return None
    sigma = max(robust_noise(values), min_shift)
    if not sigma > 0:
        return None
    mu0 = statistics.median(values[:REFERENCE_POINTS]) if reference is None else reference
    up = down = 0.0
    up_start = down_start = 0
    for i, x in enumerate(values):
        z = (x - mu0) / sigma
        up, down = max(0.0, up + z - k), max(0.0, down - z - k)
        if up == 0.0:
            up_start = i + 1
        if down == 0.0:
            down_start = i + 1
        if up > h or down > h:
            start = min(up_start if up > h else down_start, i)
            after = statistics.median(values[i:i + 1 + CONFIRM_STEPS])
            if abs(after - mu0) >= confirm * sigma:
                return steps[start], steps[i], mu0, after, sigma
            # not (yet) confirmed: keep accumulating; a brief excursion decays back to 0 on its own
    return None


def scanned_series(data: RunData) -> list[tuple[str, tuple[str, ...], SignalSpec, list[tuple[int, float]]]]:
    out = []
    for name, spec in LEADING_SIGNALS.items():
        for labels in sorted(data.label_sets(name)) or [()]:
            series = data.series(name, labels)
            if series:
                out.append((name, labels, spec, series))
    return out
