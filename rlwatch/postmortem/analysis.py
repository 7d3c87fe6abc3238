"""What went wrong and when: collapse onset, the signals that changed first, the alert timeline,
the diagnosed cause, where to resume, what the run could not measure, and how it diverged from a
good run.

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
from dataclasses import dataclass, field
from typing import Any

from ..diagnosis import Diagnosis, diagnose
from .sources import QUALITY_KEYS, RunData


@dataclass(frozen=True)
class SignalSpec:
    """How to read a signal in a post-mortem: its trouble direction and smallest meaningful shift."""

    trouble: str          # "up" | "down" | "either": which way a move means trouble
    min_shift: float      # in the signal's unit; the noise floor of the change test
    unit: str = ""
    relative: float = 0.0  # and at least this fraction of the series' largest |value| (signals of no fixed scale)

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
    "entropy_mean": SignalSpec("down", 0.05, "nats"),
    "zero_variance_groups_ratio": SignalSpec("up", 0.05),
    "truncated_ratio": SignalSpec("up", 0.05),
    "env_hack_ratio": SignalSpec("up", 0.05),
    "reward_mean": SignalSpec("down", 0.05, relative=0.1),
    "response_length_mean": SignalSpec("either", 0.5, "tokens", relative=0.1),
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

# Which signals a diagnosed cause links to the collapse.
CAUSE_SIGNALS: dict[str, tuple[str, ...]] = {
    "stale_weights": ("version_lag_", "mismatch_", "is_"),
    "weight_sync_missing": ("version_lag_", "mismatch_", "is_"),
    "temperature_mismatch": ("mismatch_", "is_"),
    "top_p_truncation": ("mismatch_", "is_"),
    "numeric_noise": ("mismatch_", "is_"),
    "reward_hacking": ("env_hack_ratio",),
}
NO_CAUSE = "no cause found"


def _label_name(signal: str, labels: tuple[str, ...]) -> str:
    shown = [l for l in labels if l]
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


# Kept for callers of the old name.
FirstSignal = Change


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


@dataclass
class Coverage:
    """Which families of signals the run carried, and why the others are missing."""

    carried: list[dict[str, Any]] = field(default_factory=list)    # {family, signals, steps}
    missing: list[dict[str, Any]] = field(default_factory=list)    # {family, why}
    notes: list[str] = field(default_factory=list)


COVERAGE_FAMILIES: list[tuple[str, tuple[str, ...], str]] = [
    ("sampler-learner mismatch", ("mismatch_kl_k3", "mismatch_abs_log_ratio_mean"),
     "no sampler log-probs: the trainer never passed sampler_logp next to trainer_logp (e.g. TRL without vLLM "
     "importance sampling keeps none), so the mismatch, its cause and the importance weights cannot be computed"),
    ("importance sampling health", ("is_ess_ratio", "is_tis_high_ratio"),
     "no sampler log-probs (needs both sampler and trainer log-probs)"),
    ("version lag (staleness)", ("version_lag_max", "version_lag_mean"),
     "no versions: no token_version/trainer_version was passed (synchronous trainers have lag 0 by design)"),
    ("zero-variance GRPO groups", ("zero_variance_groups_ratio",),
     "no groups: no group_ids with the rewards, so groups that carry no gradient cannot be counted"),
    ("entropy", ("entropy_mean",), "no per-token entropy was passed"),
    ("reward", ("reward_mean",), "no rewards were passed"),
    ("truncation", ("truncated_ratio",), "no truncated flags were passed"),
    ("reward hacks", ("env_hack_ratio",),
     "no episodes were judged by a reward-hack detector (pass episodes= with the environment's name)"),
]


def coverage(data: RunData, quality_key: str | None) -> Coverage:
    out = Coverage()
    for family, names, why in COVERAGE_FAMILIES:
        present = [n for n in names if any(n in values for _, values in data.steps)]
        if present:
            steps = sum(1 for _, values in data.steps if any(n in values for n in present))
            out.carried.append({"family": family, "signals": present, "steps": steps})
        else:
            out.missing.append({"family": family, "why": why})
    if quality_key is None:
        out.missing.append({"family": "run quality", "why": "no held-out/eval score and no reward: no collapse "
                                                            "can be dated"})
    elif quality_key == "reward_mean":
        out.notes.append("quality is the training reward (no held-out or eval score was logged: "
                         f"log one of {', '.join(QUALITY_KEYS[:3])} to date collapses a hacked reward hides)")
    else:
        out.carried.append({"family": "run quality", "signals": [quality_key],
                            "steps": len(data.scalars.get(quality_key, []))})
    if not data.checkpoints:
        out.notes.append("no checkpoints recorded (Watch.record_checkpoint, or the integrations): no resume point")
    for event in data.events:
        out.notes.append(f"run event {event.get('kind')}: {event.get('detail')}")
    return out


@dataclass
class Resume:
    """Where to resume from, and why."""

    checkpoint: tuple[int, str] | None
    reason: str
    trouble_step: int | None = None
    fallback: tuple[int, str] | None = None      # latest checkpoint before the collapse, trained with the cause

    def as_json(self) -> dict[str, Any]:
        return {"checkpoint": ({"step": self.checkpoint[0], "path": self.checkpoint[1]}
                               if self.checkpoint else None),
                "reason": self.reason, "trouble_step": self.trouble_step,
                "fallback": {"step": self.fallback[0], "path": self.fallback[1]} if self.fallback else None}


@dataclass
class Report:
    run: str
    source: str
    steps: tuple[int, int] | None
    quality_signal: str | None
    collapse_step: int | None
    peak: tuple[int, float] | None
    first_signals: list[Change]
    alerts: list[dict[str, Any]]
    diagnosis: Diagnosis
    last_healthy_checkpoint: tuple[int, str] | None
    hacks: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    probe: list[dict[str, Any]] = field(default_factory=list)   # --probe: one row per checkpoint
    resume: Resume | None = None
    coverage: Coverage = field(default_factory=Coverage)
    cause: str = NO_CAUSE
    comparison: "Comparison | None" = None

    @property
    def evidence(self) -> list[str]:
        """Why the cause was named (or none was): the diagnosis' evidence, the hack rates."""
        if self.cause == self.diagnosis.cause:
            return list(self.diagnosis.evidence)
        lines = [f"hack rate of {h['env']} / {h['detector']} rose from {h['early_rate']:.1%} to {h['late_rate']:.1%}"
                 for h in self.hacks] if self.cause == "reward_hacking" else []
        return lines + [f"sampler-learner mismatch: {e}" for e in self.diagnosis.evidence]

    @property
    def first_critical(self) -> dict[str, Any] | None:
        firing = [a for a in self.alerts if a.get("severity") == "critical" and a.get("state", "firing") == "firing"
                  and a.get("step") is not None]
        return min(firing, key=lambda a: a["step"]) if firing else None

    def as_json(self) -> dict[str, Any]:
        critical = self.first_critical
        found = self.cause != NO_CAUSE
        return {
            "run": self.run,
            "source": self.source,
            "steps": list(self.steps) if self.steps else None,
            "quality_signal": self.quality_signal,
            "collapse_step": self.collapse_step,
            "peak": {"step": self.peak[0], "value": self.peak[1]} if self.peak else None,
            "alerts": [{"name": a["name"], "severity": a.get("severity"), "step": a.get("step"),
                        "state": a.get("state", "firing"), "labels": a.get("labels", {})} for a in self.alerts],
            "first_alert_lead": (self.collapse_step - critical["step"]
                                 if critical is not None and self.collapse_step is not None else None),
            "first_signals": [c.as_json() for c in self.first_signals],
            "cause": self.cause,
            "cause_confidence": self.diagnosis.confidence if found and self.cause == self.diagnosis.cause else None,
            "mismatch_diagnosis": self.diagnosis.cause,
            "evidence": self.evidence,
            "last_healthy_checkpoint": ({"step": self.last_healthy_checkpoint[0],
                                         "path": self.last_healthy_checkpoint[1]}
                                        if self.last_healthy_checkpoint else None),
            "resume": self.resume.as_json() if self.resume else None,
            "coverage": {"carried": self.coverage.carried, "missing": self.coverage.missing,
                         "notes": self.coverage.notes},
            "hacks": self.hacks,
            "events": self.events,
            **({"probe": self.probe} if self.probe else {}),
            **({"comparison": self.comparison.as_json()} if self.comparison else {}),
        }


def quality_series(data: RunData) -> tuple[str | None, list[tuple[int, float]]]:
    """The best available measure of real policy quality: a held-out/eval scalar, else reward."""
    for key in QUALITY_KEYS:
        if data.scalars.get(key):
            return key, sorted(data.scalars[key])
    series = data.series("reward_mean")
    return ("reward_mean", series) if series else (None, [])


def collapse_onset(series: list[tuple[int, float]], fraction: float = 0.5, min_peak: float = 1e-9
                   ) -> tuple[int | None, tuple[int, float] | None]:
    """First step from which the value stays below ``fraction`` of its running peak to the end."""
    if not series:
        return None, None
    peaks, running = [], float("-inf")
    for step, value in series:
        running = max(running, value)
        peaks.append(running)
    best = max(series, key=lambda p: p[1])
    onset = None
    for i in range(len(series) - 1, -1, -1):
        step, value = series[i]
        if peaks[i] > min_peak and value < fraction * peaks[i]:
            onset = step
        else:
            break
    return onset, best


def scanned_series(data: RunData) -> list[tuple[str, tuple[str, ...], SignalSpec, list[tuple[int, float]]]]:
    out = []
    for name, spec in LEADING_SIGNALS.items():
        for labels in sorted(data.label_sets(name)) or [()]:
            series = data.series(name, labels)
            if series:
                out.append((name, labels, spec, series))
    return out


def first_changes(data: RunData, collapse: int | None = None) -> list[Change]:
    """Every scanned signal's first confirmed change, by time of change, then by size."""
    changes = []
    for name, labels, spec, series in scanned_series(data):
        found = detect_change(series, spec.floor([v for _, v in series]))
        if found is not None:
            step, alarm, before, after, sigma = found
            changes.append(Change(name, labels, step, alarm, before, after, sigma, spec.trouble,
                                  None if collapse is None else collapse - step))
    changes.sort(key=lambda c: (c.step, -abs(c.size)))
    return changes


def resume_point(data: RunData, collapse: int | None, changes: list[Change], cause: str,
                 quality_key: str | None) -> Resume:
    """The last checkpoint before the first change the diagnosis links to the collapse."""
    latest = data.checkpoints[-1] if data.checkpoints else None
    if collapse is None:
        reason = (f"no collapse of {quality_key} was found, so nothing needs resuming"
                  if quality_key else "no quality signal to date a collapse, so no resume point is recommended")
        if latest:
            reason += f" (latest checkpoint: {latest[1]}, step {latest[0]})"
        return Resume(None, reason)
    before_collapse = [c for c in changes if c.concerning and c.step <= collapse]
    prefixes = CAUSE_SIGNALS.get(cause, ())
    linked = [c for c in before_collapse if c.signal.startswith(prefixes)] if prefixes else []
    if linked:
        first = min(linked, key=lambda c: c.step)
        trouble, why = first.step, f"the first change linked to {cause}: {first.name} from step {first.step}"
    elif before_collapse:
        first = min(before_collapse, key=lambda c: c.step)
        trouble = first.step
        why = f"no cause found; the earliest change before the collapse: {first.name} from step {first.step}"
    else:
        trouble, why = collapse, f"no signal changed before the collapse at step {collapse}"
    healthy = [c for c in data.checkpoints if c[0] < trouble]
    fallback = [c for c in data.checkpoints if c[0] < collapse]
    if healthy:
        return Resume(healthy[-1], f"last checkpoint before {why}", trouble)
    if not data.checkpoints:
        return Resume(None, f"no checkpoints were recorded; the trouble began at step {trouble} ({why})", trouble)
    fb = fallback[-1] if fallback else None
    reason = (f"no checkpoint predates {why}: restart from the initial weights with the cause fixed"
              + (f"; {fb[1]} (step {fb[0]}) is the last one before the collapse, but it was trained with the "
                 "cause present" if fb else ""))
    return Resume(None, reason, trouble, fb)


def analyse(data: RunData) -> Report:
    quality_key, quality = quality_series(data)
    collapse, peak = collapse_onset(quality)
    steps = (data.steps[0][0], data.steps[-1][0]) if data.steps else None
    changes = first_changes(data, collapse)
    # Diagnose on the steps up to the collapse (or the whole run when none happened).
    window_end = collapse if collapse is not None else (steps[1] if steps else 0)
    window = [values for step, values in data.steps if step <= window_end] or [values for _, values in data.steps]
    diagnosis = diagnose(window)
    hacks = summarize_hacks(data)
    if diagnosis.cause != "none":
        cause = diagnosis.cause
    elif hacks:
        cause = "reward_hacking"
    else:
        cause = NO_CAUSE
    resume = resume_point(data, collapse, changes, cause, quality_key)
    alerts = [a for a in data.alerts if a.get("state", "firing") == "firing"]
    return Report(run=data.run, source=data.source, steps=steps, quality_signal=quality_key, collapse_step=collapse,
                  peak=peak, first_signals=changes, alerts=alerts, diagnosis=diagnosis,
                  last_healthy_checkpoint=resume.checkpoint, hacks=hacks, events=data.events, resume=resume,
                  coverage=coverage(data, quality_key), cause=cause)


def summarize_hacks(data: RunData) -> list[dict[str, Any]]:
    """Environments and detectors whose hack rate rose, with a few example episodes."""
    out = []
    for labels in sorted(data.label_sets("env_hack_ratio")):
        series = data.series("env_hack_ratio", labels)
        if len(series) < 4 or len(labels) != 2:
            continue
        quarter = max(1, len(series) // 4)
        early = statistics.mean(v for _, v in series[:quarter])
        late = statistics.mean(v for _, v in series[-quarter:])
        if late > max(0.05, 2 * early):
            env, detector = labels
            examples = [e for e in data.hack_examples if e.get("env") == env and e.get("detector") == detector][:3]
            out.append({"env": env, "detector": detector, "early_rate": early, "late_rate": late,
                        "examples": examples})
    return out


# --- comparison with a good run ----------------------------------------------------------------------

@dataclass
class Divergence:
    """Where ``signal`` in the bad run left the good run's: dated at ``step``, confirmed at ``alarm_step``."""

    signal: str
    labels: tuple[str, ...]
    step: int
    alarm_step: int
    difference: float     # bad - good, the level after the divergence
    noise: float
    bad: float            # the bad run's level after the divergence
    good: float           # the good run's level over the same steps

    @property
    def name(self) -> str:
        return _label_name(self.signal, self.labels)

    @property
    def size(self) -> float:
        return self.difference / self.noise if self.noise > 0 else math.inf

    def as_json(self) -> dict[str, Any]:
        return {"signal": self.name, "step": self.step, "alarm_step": self.alarm_step,
                "difference": _clean_zero(self.difference), "size": _finite(self.size), "noise": self.noise,
                "bad": _clean_zero(self.bad), "good": _clean_zero(self.good)}


@dataclass
class Comparison:
    bad: str
    good: str
    common_steps: tuple[int, int, int] | None       # first, last, count
    compared: list[str]
    divergences: list[Divergence]
    only_bad: list[str] = field(default_factory=list)
    only_good: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"bad": self.bad, "good": self.good,
                "common_steps": list(self.common_steps) if self.common_steps else None,
                "compared": self.compared, "divergences": [d.as_json() for d in self.divergences],
                "only_in_bad_run": self.only_bad, "only_in_good_run": self.only_good}


def _compared_series(data: RunData) -> dict[tuple[str, tuple[str, ...]], tuple[SignalSpec, list[tuple[int, float]]]]:
    out = {(name, labels): (spec, series) for name, labels, spec, series in scanned_series(data)}
    for key in QUALITY_KEYS:
        if data.scalars.get(key):
            out[(key, ())] = (QUALITY_SPEC, sorted(data.scalars[key]))
    return out


def compare(bad: RunData, good: RunData) -> Comparison:
    """Align two runs by step and find where each signal of ``bad`` first diverged from ``good``:
    the same CUSUM on the per-step difference bad - good, with reference 0 (runs that agree)."""
    a, b = _compared_series(bad), _compared_series(good)
    common_steps = sorted({s for s, _ in bad.steps} & {s for s, _ in good.steps}
                          | ({s for pts in (x[1] for x in a.values()) for s, _ in pts}
                             & {s for pts in (x[1] for x in b.values()) for s, _ in pts}))
    divergences, compared = [], []
    for key in sorted(set(a) & set(b)):
        spec, bad_series = a[key]
        good_at = dict(b[key][1])
        pairs = [(s, v, good_at[s]) for s, v in bad_series if s in good_at]
        if len(pairs) < REFERENCE_POINTS + 2:
            continue
        compared.append(_label_name(*key))
        floor = spec.floor([y for _, _, y in pairs])             # the good run sets the scale
        found = detect_change([(s, x - y) for s, x, y in pairs], floor, reference=0.0, h=COMPARE_H,
                              confirm=COMPARE_CONFIRM)
        if found is None:
            continue
        step, alarm, _, difference, sigma = found
        window = [(x, y) for s, x, y in pairs if alarm <= s <= alarm + CONFIRM_STEPS]
        divergences.append(Divergence(key[0], key[1], step, alarm, difference, sigma,
                                      statistics.median(x for x, _ in window), statistics.median(y for _, y in window)))
    divergences.sort(key=lambda d: (d.step, -abs(d.size)))
    span = (common_steps[0], common_steps[-1], len(common_steps)) if common_steps else None
    return Comparison(bad=f"{bad.run} ({bad.source})", good=f"{good.run} ({good.source})", common_steps=span,
                      compared=compared, divergences=divergences,
                      only_bad=sorted(_label_name(*k) for k in set(a) - set(b)),
                      only_good=sorted(_label_name(*k) for k in set(b) - set(a)))
