"""The real-scale family's verdicts: replay its traces through the alert listeners and score them.

Bars (at the shipped defaults, on the test split of :mod:`evaluation.realscale`):

- 0 critical pages on healthy runs;
- every collapse paged before the reward collapses;
- lead fraction (collapse - first critical) / (collapse - departure): median >= 0.7, min >= 0.5;
- mismatch warnings (drift, jump) at most 0.1 per healthy run of 600 steps;
- on a slow collapse (>= 400 steps of warning), the first mismatch warning within the first quarter
  of the departure-to-collapse time.

    python -m evaluation.realscale_eval --cache .rlwatch-realscale
"""

from __future__ import annotations

import argparse
import json
import statistics

from .acceptance_score import MISMATCH_WARNINGS, Event, Outcome
from .realscale import HEALTHY_STEPS, collect_all, runs

#: A collapse with at least this many steps from departure to collapse is slow.
SLOW_STEPS = 400


def replay(trace: dict, overrides: dict[str, float]) -> Outcome:
    """The events the Watch's listeners (drift, alert windows, embedded evaluator) give on ``trace``."""
    from rlwatch.alerts.evaluator import AlertEvaluator
    from rlwatch.alerts.windows import AlertWindows
    from rlwatch.analyses.drift import DriftDetector
    from .matrix import derived

    run = trace["spec"]
    static = {"staleness_bound": {(): float(trace["staleness_bound"])}, "is_cap": {(): 2.0}}
    listeners = [DriftDetector(), AlertWindows(overrides, static)]
    evaluator = AlertEvaluator(run.name, overrides=overrides, watchdog_interval=0, static=static)
    for step, raw in trace["steps"]:
        values = {k: dict(v) for k, v in raw.items() if not derived(k)}
        for listener in listeners:
            values.update(listener.on_step(step, values) or {})
        evaluator.on_step(step, values)
    events = [Event(e.name, e.severity, e.state, int(e.step), dict(e.labels), e.value) for e in evaluator.events]
    firing = sorted({e.name for e in evaluator.firing()})
    evaluator.close()
    return Outcome(run=run.name, family=run.family, scenario=run.scenario, kind=run.kind, seed=run.seed,
                   steps=len(trace["steps"]), collapse_step=trace["collapse_step"], events=events,
                   firing_at_end=firing)


def lead_fraction(o: Outcome, depart: int) -> float | None:
    """(collapse - first critical) / (collapse - departure); None when not paged before the collapse."""
    if o.lead is None or o.collapse_step is None:
        return None
    return o.lead / max(1, o.collapse_step - depart)


def first_warning_fraction(o: Outcome, depart: int) -> float | None:
    """How far into the departure-to-collapse time the first mismatch warning came (negative: before
    the departure); None when none came before the collapse."""
    steps = [e.step for e in o.firings("warning") if e.name in MISMATCH_WARNINGS and e.step < (o.collapse_step or 0)]
    if not steps or o.collapse_step is None:
        return None
    return (min(steps) - depart) / max(1, o.collapse_step - depart)


def score(outcomes: list[Outcome], departs: dict[str, int | None]) -> dict[str, object]:
    healthy = [o for o in outcomes if o.kind == "healthy"]
    collapse = [o for o in outcomes if o.kind == "collapse"]
    fractions = [f for o in collapse if (f := lead_fraction(o, departs[o.run])) is not None]
    slow = [o for o in collapse if o.collapse_step - departs[o.run] >= SLOW_STEPS]
    warned = [first_warning_fraction(o, departs[o.run]) for o in slow]
    per_run = HEALTHY_STEPS / max(1, statistics.mean(o.steps for o in healthy)) if healthy else 1.0
    mismatch_warnings = sum(1 for o in healthy for e in o.firings("warning") if e.name in MISMATCH_WARNINGS)
    return {
        "runs": len(outcomes), "healthy_runs": len(healthy), "collapse_runs": len(collapse),
        "healthy_critical_pages": sum(len(o.firings("critical")) for o in healthy),
        "healthy_warnings": sum(len(o.firings("warning")) for o in healthy),
        "healthy_mismatch_warnings": mismatch_warnings,
        "mismatch_warnings_per_healthy_run": round(mismatch_warnings * per_run / max(1, len(healthy)), 3),
        "collapsed_paged_before": len(fractions),
        "lead_fraction_median": round(statistics.median(fractions), 3) if fractions else None,
        "lead_fraction_min": round(min(fractions), 3) if fractions else None,
        "slow_collapses": len(slow),
        "slow_first_warning_fraction_max": (round(max(warned), 3) if warned and None not in warned else None),
        "slow_warned": sum(w is not None for w in warned),
    }


def bars(s: dict) -> dict[str, bool]:
    return {
        "0 critical pages on healthy runs": s["healthy_critical_pages"] == 0,
        "every collapse paged before it": s["collapsed_paged_before"] == s["collapse_runs"],
        "lead fraction median >= 0.7": (s["lead_fraction_median"] or 0) >= 0.7,
        "lead fraction min >= 0.5": (s["lead_fraction_min"] or 0) >= 0.5,
        "mismatch warnings <= 0.1 per healthy 600-step run": s["mismatch_warnings_per_healthy_run"] <= 0.1,
        "slow collapses: first mismatch warning within the first quarter": (
            s["slow_warned"] == s["slow_collapses"] and (s["slow_first_warning_fraction_max"] or 0) <= 0.25),
    }


def precision(outcomes: list[Outcome]) -> dict[str, dict[str, object]]:
    """Per alert: firings on healthy runs, on collapse runs, and the share of its firings on faulty runs."""
    from rlwatch.alerts.catalogue import ALERTS

    table: dict[str, dict[str, object]] = {}
    for alert in ALERTS:
        healthy = sum(1 for o in outcomes if o.kind == "healthy" for e in o.firings() if e.name == alert.name)
        faulty = sum(1 for o in outcomes if o.kind != "healthy" for e in o.firings() if e.name == alert.name)
        table[alert.name] = {"severity": alert.severity, "healthy": healthy, "faulty": faulty,
                             "precision": round(faulty / (healthy + faulty), 3) if healthy + faulty else "-"}
    return table


def evaluate(split: str, overrides: dict[str, float], cache: str | None, jobs: int = 1,
             only: tuple[str, ...] = ()) -> dict[str, object]:
    """Collect (or load) the split's traces, replay them at ``overrides``; the score, bars, per-alert
    precision and per-run rows."""
    selected = [r for r in runs(split) if not only or r.shape.name in only]
    traces = collect_all(selected, cache, jobs)
    outcomes = [replay(t, overrides) for t in traces]
    departs = {t["spec"].name: t["depart_step"] for t in traces}
    s = score(outcomes, departs)
    rows = [{"run": o.run, "kind": o.kind, "steps": o.steps, "depart": departs[o.run], "collapse": o.collapse_step,
             "first_critical": o.first_critical.step if o.first_critical else None,
             "lead_fraction": lead_fraction(o, departs[o.run]) if o.kind == "collapse" else None,
             "first_mismatch_warning": first_warning_fraction(o, departs[o.run]) if o.kind == "collapse" else None,
             "firings": [f"{e.name}@{e.step}" for e in o.firings()]} for o in outcomes]
    return {"split": split, "overrides": overrides, "summary": s, "bars": bars(s), "precision": precision(outcomes),
            "runs": rows, "traces": traces}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=".rlwatch-realscale")
    parser.add_argument("--split", choices=("tuning", "test"), default="test")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="override PARAM=VALUE")
    args = parser.parse_args(argv)
    overrides = {k: float(v) for k, v in (item.split("=") for item in args.set)}
    result = evaluate(args.split, overrides, args.cache, args.jobs)
    result.pop("traces")
    print(json.dumps({k: result[k] for k in ("summary", "bars", "precision")}, indent=1))
    for row in result["runs"]:
        print(row)
    return 0 if all(result["bars"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
