"""What went wrong and when: collapse onset, the signals that changed first, the alert timeline,
the diagnosed cause, where to resume, what the run could not measure, and (:mod:`.compare`) how it
diverged from a good run. The change test itself is :mod:`rlwatch.postmortem.changes`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ..alerts.catalogue import with_role
from ..analyses.diagnosis import Diagnosis, diagnose
from .changes import Change, detect_change, scanned_series
from .compare import Comparison
from .gaps import MissingSteps
from .sources import QUALITY_KEYS, RunData

__all__ = ["CAUSE_SIGNALS", "COLLAPSE_FRACTION", "COLLAPSE_HOLD", "COLLAPSE_TAIL", "MISMATCH_ALERTS", "NO_CAUSE",
           "Collapse", "Coverage", "KL_ALERTS", "LAG_ALERTS", "Report", "Resume", "analyse", "collapse_onset",
           "correction_held", "correction_in_use", "coverage", "find_collapse",
           "first_changes", "quality_series", "resume_point", "summarize_hacks"]


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
#: Alerts on the sampler-learner mismatch and the lag: one of them firing makes a diagnosed cause
#: the run's cause even where the run did not degrade. Read from the alerts' roles (``Alert(roles=...)``
#: in their domain modules, :data:`rlwatch.alerts.model.ROLES`): a lag, KL or importance alert is a mismatch alert.
MISMATCH_ALERTS = frozenset(with_role("mismatch", "lag", "kl", "importance"))


#: Alerts on the lag, and on the KL between sampler and learner: both firing in a run that kept its
#: quality while a behaviour correction was on is a lag fault the correction held.
LAG_ALERTS = with_role("lag")
KL_ALERTS = with_role("kl")
#: What a correction acting on stale data shows when the KL stays below its alerts: weights truncated, ESS low.
IS_ALERTS = with_role("importance")


def correction_in_use(meta: dict[str, Any]) -> str | None:
    """The behaviour correction the run trained with, from its metadata (at any depth):
    ``correction`` (``Watch(metadata={"correction": "tis"})``; rlwatch demo sets it), TRL's
    ``vllm_importance_sampling_correction`` (with its mode), OpenRLHF's ``is_correction``."""
    found: dict[str, Any] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                found.setdefault(str(key), value)
                walk(value)
    walk(meta)
    named = str(found.get("correction") or "").strip()
    if named and named.lower() not in ("none", "off", "false", "0"):
        return named.upper() if named.lower() in ("tis", "mis") else named
    if found.get("vllm_importance_sampling_correction") is True:
        return f"TRL's importance sampling ({found.get('vllm_importance_sampling_mode') or 'default mode'})"
    if found.get("is_correction") is True:
        return "OpenRLHF's importance-sampling correction"
    return None


def correction_held(data: RunData, alerts: list[dict[str, Any]], collapse: int | None,
                    quality_key: str | None) -> str | None:
    """Why a run with lag alerts and KL (or, failing those, importance-sampling) alerts did not collapse, where
    a correction was on; else None."""
    correction = correction_in_use(data.meta)
    if collapse is not None or quality_key is None or correction is None:
        return None
    dated = sorted((a for a in alerts if a.get("step") is not None), key=lambda a: a["step"])
    lag = next((a for a in dated if a["name"] in LAG_ALERTS), None)
    kl = next((a for a in dated if a["name"] in KL_ALERTS), None) or next(
        (a for a in dated if a["name"] in IS_ALERTS), None)
    if lag is None or kl is None:
        return None
    return (f"the correction ({correction}) held a lag fault: {lag['name']} fired at step {lag['step']} and "
            f"{kl['name']} at step {kl['step']}, yet {quality_key} did not collapse; the stale sampler is still "
            "there (fix the lag before turning the correction off)")


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
    elif quality_key == "reward_mean" and (heldout := len(data.series("heldout_score"))):
        out.notes.append(f"quality is the training reward: the held-out score was logged {heldout} times, fewer "
                         f"than the {COLLAPSE_HOLD + COLLAPSE_TAIL} evaluations that date a collapse (evaluate more "
                         "often to date collapses a hacked reward hides)")
    elif quality_key == "reward_mean":
        out.notes.append("quality is the training reward (no held-out or eval score was logged: "
                         f"log one of {', '.join(QUALITY_KEYS[:3])} to date collapses a hacked reward hides)")
    else:
        out.carried.append({"family": "run quality", "signals": [quality_key],
                            "steps": len(data.scalars.get(quality_key, [])) or len(data.series(quality_key))})
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
    collapse: "Collapse | None"
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
    superseded_alerts: list[dict[str, Any]] = field(default_factory=list)       # see RunData
    superseded_checkpoints: list[dict[str, Any]] = field(default_factory=list)
    correction_held: str | None = None            # see correction_held()
    concurrent_writers: list[list[dict[str, Any]]] = field(default_factory=list)      # see RunData
    missing_steps: MissingSteps | None = None                                         # see RunData

    @property
    def explanation(self) -> str | None:
        """What the mismatch comes from where the diagnosis found a cause the run did not suffer from."""
        if self.diagnosis.cause == "none" or self.cause == self.diagnosis.cause:
            return None
        return f"mismatch explained by {self.diagnosis.name}, below alert levels"

    @property
    def cause_name(self) -> str:
        """The cause as reported: every diagnosed cause, the largest first, where the diagnosis named it."""
        return self.diagnosis.name if self.cause == self.diagnosis.cause else self.cause

    @property
    def evidence(self) -> list[str]:
        """Why the cause was named (or none was): the diagnosis' evidence, the hack rates."""
        if self.cause == self.diagnosis.cause:
            return list(self.diagnosis.evidence)
        lines = [f"hack rate of {h['env']} / {h['detector']} " + (
                 f"rose from {h['early_rate']:.1%} to {h['late_rate']:.1%}" if h["late_rate"] > 2 * h["early_rate"]
                 else f"high from the first steps: {h['early_rate']:.1%}, then {h['late_rate']:.1%}")
                 + (f" from step {h['step']}" if h.get("step") is not None else "")
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
            "missing_steps": self.missing_steps.as_json() if self.missing_steps else None,
            "quality_signal": self.quality_signal,
            "collapse_step": self.collapse_step,
            "peak": {"step": self.peak[0], "value": self.peak[1]} if self.peak else None,
            "recovery": self.collapse.recovery_json() if self.collapse is not None else None,
            "collapse_rule": {"fraction_of_running_peak": COLLAPSE_FRACTION, "for_evaluations": COLLAPSE_HOLD,
                              "or_to_the_end_over": COLLAPSE_TAIL},
            "alerts": [{"name": a["name"], "severity": a.get("severity"), "step": a.get("step"),
                        "state": a.get("state", "firing"), "labels": a.get("labels", {}),
                        **({"attempt": a.get("attempt")} if self.concurrent_writers else {})} for a in self.alerts],
            "first_alert_lead": (self.collapse_step - critical["step"]
                                 if critical is not None and self.collapse_step is not None else None),
            "first_signals": [c.as_json() for c in self.first_signals],
            "cause": self.cause,
            "causes": (self.diagnosis.causes if self.cause == self.diagnosis.cause else [self.cause]) if found else [],
            "cause_confidence": self.diagnosis.confidence if found and self.cause == self.diagnosis.cause else None,
            "cause_accuracy": self.diagnosis.accuracy if found and self.cause == self.diagnosis.cause else None,
            "mismatch_diagnosis": self.diagnosis.cause,
            "mismatch_explanation": self.explanation,
            "evidence": self.evidence,
            "correction_held": self.correction_held,
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
            **({"superseded": {"alerts": self.superseded_alerts, "checkpoints": self.superseded_checkpoints}}
               if self.superseded_alerts or self.superseded_checkpoints else {}),
            **({"concurrent_writers": self.concurrent_writers} if self.concurrent_writers else {}),
        }


def quality_series(data: RunData) -> tuple[str | None, list[tuple[int, float]]]:
    """The best available measure of real policy quality: a held-out/eval scalar (or the held-out score a
    trainer logs under a recognised name, docs/trainer-dynamics.md, when it was evaluated at least
    COLLAPSE_HOLD + COLLAPSE_TAIL times: a sparse one cannot date a collapse), else reward."""
    for key in QUALITY_KEYS:
        if data.scalars.get(key):
            return key, sorted(data.scalars[key])
    heldout = data.series("heldout_score")
    if len(heldout) >= COLLAPSE_HOLD + COLLAPSE_TAIL:      # evaluated often enough to date a collapse
        return "heldout_score", heldout
    reward = data.series("reward_mean")
    if reward or heldout:
        return ("reward_mean", reward) if reward else ("heldout_score", heldout)
    return None, []


#: A collapse is dated at the first evaluation where the quality falls below COLLAPSE_FRACTION of its
#: running peak and stays below for COLLAPSE_HOLD consecutive evaluations (steps, when it is evaluated
#: every step), or to the end of the run when the run ends sooner, over at least COLLAPSE_TAIL of them.
#: A later climb back is reported as a recovery, never moves the date. Chosen on the tuning curves of
#: ``python -m bench.collapse_tuning`` and reported there on separate test curves.
COLLAPSE_FRACTION = 0.4
COLLAPSE_HOLD = 8
COLLAPSE_TAIL = 3


@dataclass
class Collapse:
    """A dated collapse: its first step, the running peak it fell from (step, value), the best value
    after it where that climbed back to at least the fraction of the peak (a recovery), and the last
    value (step, value)."""

    step: int
    peak: tuple[int, float]
    recovery: tuple[int, float] | None
    last: tuple[int, float]

    def recovery_json(self) -> dict[str, Any] | None:
        if self.recovery is None:
            return None
        return {"step": self.recovery[0], "value": self.recovery[1], "of_peak": self.recovery[1] / self.peak[1],
                "text": self.recovery_text()}

    @property
    def recovered_fully(self) -> bool:
        return self.recovery is not None and self.recovery[1] >= self.peak[1]

    def recovery_text(self) -> str | None:
        """"recovered to 0.33 at step 88, below its peak of 0.53; 0.08 at step 99", or None."""
        if self.recovery is None:
            return None
        step, value = self.recovery
        where = "back to its peak" if self.recovered_fully else f"below its peak of {self.peak[1]:.2f}"
        text = f"recovered to {value:.2f} at step {step}, {where}"
        return text if self.last[0] == step else text + f"; {self.last[1]:.2f} at step {self.last[0]}"


def find_collapse(series: list[tuple[int, float]], fraction: float = COLLAPSE_FRACTION, hold: int = COLLAPSE_HOLD,
                  tail: int = COLLAPSE_TAIL, min_peak: float = 1e-9) -> Collapse | None:
    """The first sustained drop of ``series`` ((step, value) by step) below ``fraction`` of its
    running peak: ``hold`` evaluations in a row, or ``tail`` or more that last to the run's end."""
    peaks: list[tuple[int, float]] = []
    best: tuple[int, float] | None = None
    for step, value in series:
        if best is None or value > best[1]:
            best = (step, value)
        peaks.append(best)
    below = [peak[1] > min_peak and value < fraction * peak[1] for (_, value), peak in zip(series, peaks)]
    n = len(series)
    for i in range(n):
        stretch = below[i:i + hold]
        if all(stretch) and (len(stretch) == hold or len(stretch) >= tail):
            after = [p for p in series[i + 1:] if p[1] >= fraction * peaks[i][1]]
            recovery = max(after, key=lambda p: p[1]) if after else None
            return Collapse(series[i][0], peaks[i], recovery, series[-1])
    return None


def collapse_onset(series: list[tuple[int, float]], fraction: float = COLLAPSE_FRACTION, min_peak: float = 1e-9
                   ) -> tuple[int | None, tuple[int, float] | None]:
    """(the step :func:`find_collapse` dates, or None; the series' best (step, value), or None)."""
    if not series:
        return None, None
    found = find_collapse(series, fraction, min_peak=min_peak)
    return (found.step if found else None), max(series, key=lambda p: p[1])


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
                 quality_key: str | None, peak_step: int | None = None) -> Resume:
    """The last checkpoint before the first change the diagnosis links to the collapse; with no cause
    found, before the first concerning change from the quality's peak (``peak_step``) on: the run still
    improved after an earlier change (a real run's entropy falls in its first steps), so that change is
    not where its trouble began."""
    latest = data.checkpoints[-1] if data.checkpoints else None
    if collapse is None:
        reason = (f"no collapse of {quality_key} was found, so nothing needs resuming"
                  if quality_key else "no quality signal to date a collapse, so no resume point is recommended")
        if latest:
            reason += f" (latest checkpoint: {latest[1]}, step {latest[0]})"
        return Resume(None, reason)
    before_collapse = [c for c in changes if c.concerning and c.step <= collapse]
    after_peak = [c for c in before_collapse if peak_step is None or c.step >= peak_step]
    peak = f"the peak of {quality_key} at step {peak_step}"
    prefixes = CAUSE_SIGNALS.get(cause, ())
    linked = [c for c in before_collapse if c.signal.startswith(prefixes)] if prefixes else []
    if linked:
        first = min(linked, key=lambda c: c.step)
        trouble, why = first.step, f"the first change linked to {cause}: {first.name} from step {first.step}"
    elif after_peak:
        first = min(after_peak, key=lambda c: c.step)
        trouble = first.step
        since = f"the first change since {peak}" if peak_step is not None else "the earliest change before the collapse"
        why = f"no cause found; {since}: {first.name} from step {first.step}"
    elif before_collapse:
        trouble, why = collapse, f"the collapse at step {collapse}; no signal changed since {peak}"
    else:
        trouble, why = collapse, f"the collapse at step {collapse}; no signal changed before it"
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
    found = find_collapse(quality)
    collapse, peak = (found.step if found else None), (max(quality, key=lambda p: p[1]) if quality else None)
    steps = (data.steps[0][0], data.steps[-1][0]) if data.steps else None
    changes = first_changes(data, collapse)
    # Diagnose on the steps up to the collapse (or the whole run when none happened).
    window_end = collapse if collapse is not None else (steps[1] if steps else 0)
    window = [values for step, values in data.steps if step <= window_end] or [values for _, values in data.steps]
    diagnosis = diagnose(window)
    alerts = [a for a in data.alerts if a.get("state", "firing") == "firing"]
    hacks = summarize_hacks(data, changes, alerts)
    # A cause is named where the run degraded or an alert on the mismatch fired; otherwise the
    # diagnosis only explains a mismatch that stayed below alert levels (Report.explanation).
    suffered = collapse is not None or any(a.get("name") in MISMATCH_ALERTS for a in alerts)
    if diagnosis.cause != "none" and suffered:
        cause = diagnosis.cause
    elif hacks:
        cause = "reward_hacking"
    else:
        cause = NO_CAUSE
    resume = resume_point(data, collapse, changes, cause, quality_key, found.peak[0] if found else None)
    return Report(run=data.run, source=data.source, steps=steps, quality_signal=quality_key, collapse_step=collapse,
                  peak=peak, collapse=found, first_signals=changes, alerts=alerts, diagnosis=diagnosis,
                  last_healthy_checkpoint=resume.checkpoint, hacks=hacks, events=data.events, resume=resume,
                  coverage=coverage(data, quality_key), cause=cause,
                  superseded_alerts=[a for a in data.superseded_alerts if a.get("state", "firing") == "firing"],
                  superseded_checkpoints=data.superseded_checkpoints, concurrent_writers=data.concurrent_writers,
                  missing_steps=data.missing_steps,
                  correction_held=correction_held(data, alerts, collapse, quality_key))


def summarize_hacks(data: RunData, changes: list[Change] = (), alerts: list[dict[str, Any]] = ()
                    ) -> list[dict[str, Any]]:
    """Environments and detectors with a reward hack, with a few example episodes: a hack rate that
    rose (the last quarter's mean above twice the first quarter's and 5%), one already high (the last
    quarter's mean at least the hack alert's ``hack_ratio_max``: a hack present from the first steps
    does not rise), or one whose hack alert fired. The rates are the change test's levels before and
    after the change where it dated a rise (the first-movers table shows the same numbers), else the
    first and last quarters' means."""
    from ..alerts.domains.hacks import PARAMS, REWARD_HACK_RATE_RISING

    high = PARAMS["hack_ratio_max"].default
    paged = {(str(a.get("labels", {}).get("env")), str(a.get("labels", {}).get("detector"))) for a in alerts
             if a.get("name") == REWARD_HACK_RATE_RISING.name and isinstance(a.get("labels"), dict)}
    out = []
    dated = {c.labels: c for c in changes if c.signal == "env_hack_ratio"}
    for labels in sorted(data.label_sets("env_hack_ratio")):
        series = data.series("env_hack_ratio", labels)
        if len(series) < 4 or len(labels) != 2:
            continue
        quarter = max(1, len(series) // 4)
        early = statistics.mean(v for _, v in series[:quarter])
        late = statistics.mean(v for _, v in series[-quarter:])
        if late > max(0.05, 2 * early) or late >= high or tuple(labels) in paged:
            change = dated.get(labels)
            if change is None or change.after <= change.before:
                change = None
            else:
                early, late = change.before, change.after
            env, detector = labels
            examples = [e for e in data.hack_examples if e.get("env") == env and e.get("detector") == detector]
            # From the rise on (what the hack looks like, not step 0's noise); undated: the latest ones.
            rising = [e for e in examples if change is not None and (e.get("step") or 0) >= change.step]
            examples = rising[:3] or examples[-3:]
            out.append({"env": env, "detector": detector, "early_rate": early, "late_rate": late,
                        "step": change.step if change is not None else None, "examples": examples})
    return out
