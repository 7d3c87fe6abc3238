"""What went wrong and when: collapse onset, the signals that moved first, the alert timeline,
the diagnosed cause, and the last healthy checkpoint to resume from."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ..diagnosis import Diagnosis, diagnose
from .sources import QUALITY_KEYS, RunData

# Signals whose departure from their own early baseline announces trouble: name -> direction.
LEADING_SIGNALS: dict[str, str] = {
    "mismatch_kl_k3": "up",
    "mismatch_abs_log_ratio_p99": "up",
    "mismatch_abs_log_ratio_mean": "up",
    "is_tis_high_ratio": "up",
    "is_tis_low_ratio": "up",
    "is_ess_ratio": "down",
    "version_lag_max": "up",
    "entropy_mean": "down",
    "zero_variance_groups_ratio": "up",
    "truncated_ratio": "up",
    "env_hack_ratio": "up",
}


@dataclass
class FirstSignal:
    signal: str
    labels: tuple[str, ...]
    step: int
    lead: int | None
    baseline: float
    value: float

    @property
    def name(self) -> str:
        return self.signal + (f"{{{','.join(l for l in self.labels if l)}}}" if any(self.labels) else "")


@dataclass
class Report:
    run: str
    source: str
    steps: tuple[int, int] | None
    quality_signal: str | None
    collapse_step: int | None
    peak: tuple[int, float] | None
    first_signals: list[FirstSignal]
    alerts: list[dict[str, Any]]
    diagnosis: Diagnosis
    last_healthy_checkpoint: tuple[int, str] | None
    hacks: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    probe: list[dict[str, Any]] = field(default_factory=list)   # --probe: one row per checkpoint

    @property
    def first_critical(self) -> dict[str, Any] | None:
        firing = [a for a in self.alerts if a.get("severity") == "critical" and a.get("state", "firing") == "firing"
                  and a.get("step") is not None]
        return min(firing, key=lambda a: a["step"]) if firing else None

    def as_json(self) -> dict[str, Any]:
        critical = self.first_critical
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
            "first_signals": [{"signal": f.name, "step": f.step, "lead": f.lead, "baseline": f.baseline,
                               "value": f.value} for f in self.first_signals],
            "cause": self.diagnosis.cause,
            "cause_confidence": self.diagnosis.confidence,
            "evidence": self.diagnosis.evidence,
            "last_healthy_checkpoint": ({"step": self.last_healthy_checkpoint[0],
                                         "path": self.last_healthy_checkpoint[1]}
                                        if self.last_healthy_checkpoint else None),
            "hacks": self.hacks,
            "events": self.events,
            **({"probe": self.probe} if self.probe else {}),
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


def first_departure(series: list[tuple[int, float]], direction: str, until: int | None, baseline_steps: int = 10,
                    z: float = 4.0, persist: int = 3) -> tuple[int, float, float] | None:
    """First step (before ``until``) from which a series leaves its early baseline by ``z`` robust
    standard deviations for ``persist`` consecutive points: (step, baseline, value)."""
    points = [(s, v) for s, v in series if until is None or s <= until]
    if len(points) < baseline_steps + persist:
        return None
    base = [v for _, v in points[:baseline_steps]]
    med = statistics.median(base)
    mad = statistics.median(abs(v - med) for v in base)
    scale = max(1.4826 * mad, 0.1 * abs(med), 1e-6)
    run = 0
    for i in range(baseline_steps, len(points)):
        step, value = points[i]
        moved = (value - med) / scale if direction == "up" else (med - value) / scale
        run = run + 1 if moved > z else 0
        if run >= persist:
            first_step, first_value = points[i - persist + 1]
            return first_step, med, first_value
    return None


def analyse(data: RunData) -> Report:
    quality_key, quality = quality_series(data)
    collapse, peak = collapse_onset(quality)
    steps = (data.steps[0][0], data.steps[-1][0]) if data.steps else None
    firsts: list[FirstSignal] = []
    for name, direction in LEADING_SIGNALS.items():
        for labels in sorted(data.label_sets(name)) or [()]:
            found = first_departure(data.series(name, labels), direction, collapse)
            if found is not None:
                step, baseline, value = found
                firsts.append(FirstSignal(name, labels, step, None if collapse is None else collapse - step,
                                          baseline, value))
    firsts.sort(key=lambda f: f.step)
    # Diagnose on the steps leading to the collapse (or the whole run when none happened).
    window_end = collapse if collapse is not None else (steps[1] if steps else 0)
    earliest = firsts[0].step if firsts else window_end
    window = [values for step, values in data.steps if earliest - 10 <= step <= window_end] or \
        [values for _, values in data.steps]
    diagnosis = diagnose(window)
    alerts = [a for a in data.alerts if a.get("state", "firing") == "firing"]
    critical_steps = [a["step"] for a in alerts if a.get("severity") == "critical" and a.get("step") is not None]
    trouble = min([s for s in critical_steps] + ([firsts[0].step] if firsts else []) +
                  ([collapse] if collapse is not None else []), default=None)
    healthy = [c for c in data.checkpoints if trouble is None or c[0] < trouble]
    hacks = summarize_hacks(data)
    return Report(run=data.run, source=data.source, steps=steps, quality_signal=quality_key, collapse_step=collapse,
                  peak=peak, first_signals=firsts, alerts=alerts, diagnosis=diagnosis,
                  last_healthy_checkpoint=healthy[-1] if healthy else None, hacks=hacks,
                  events=data.events)


def summarize_hacks(data: RunData) -> list[dict[str, Any]]:
    """Environments and detectors whose hack rate rose, with a few example episodes."""
    out = []
    for labels in sorted(data.label_sets("env_hack_ratio")):
        series = data.series("env_hack_ratio", labels)
        if len(series) < 4:
            continue
        quarter = max(1, len(series) // 4)
        early = statistics.mean(v for _, v in series[:quarter])
        late = statistics.mean(v for _, v in series[-quarter:])
        if late > max(0.05, 2 * early):
            env, detector = labels
            examples = [e for e in data.hack_examples if e["env"] == env and e["detector"] == detector][:3]
            out.append({"env": env, "detector": detector, "early_rate": early, "late_rate": late,
                        "examples": examples})
    return out
