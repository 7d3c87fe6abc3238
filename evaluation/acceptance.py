"""The alert acceptance report: precision and recall of the pager over the scenario matrix.

Replays the cached traces of :mod:`evaluation.matrix` (training runs of two policy families on two
task sets, collected once) through the same step listeners a ``Watch`` runs (drift detector, alert
windows, embedded evaluator), chooses the scale-dependent thresholds on the tuning split of seeds,
and reports on the test split:

- per alert: pages (critical firings) and warnings on healthy runs, firings on every kind of run;
- collapses: recall (paged before the held-out true reward collapsed), lead time min / median, and
  the lead as a fraction of the steps to the collapse;
- semantic faults: critical within 10 steps and still firing at the end of the run;
- hacks: the hack alert on the buggy environment only;
- flaps: the same alert (same labels) opening again within 10 steps of resolving;
- one verdict: on a sample of runs, Prometheus' rule engine (promtool) replays the exported window
  values with a step every 10 s and must fire exactly the alerts the embedded evaluator fires, at
  every step.

    python -m evaluation.matrix --split all --cache .rlwatch-matrix --jobs 2     # train (once)
    python -m evaluation.acceptance --cache .rlwatch-matrix --out alerts/acceptance

writes ``alerts/acceptance.md`` and ``alerts/acceptance.json`` and exits 1 when a bar is missed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from .matrix import FAMILIES, SCENARIOS, TEST_SEEDS, TUNING_SEEDS, RunSpec, collect, derived, specs
from .acceptance_score import (HACK_HOLD, INTERMITTENT_STEPS, STALENESS_BOUND, TUNED_PARAMS, Event, Outcome, bars,
                               refirings, score)
from .scale_free import RATIO_BOUNDS, ratio_trial

#: Thresholds tuned on the tuning split (their scale depends on the policy: the toy policies move far
#: more per update than a large model, see rlwatch.demo.WATCH_CONFIG), with the candidates tried;
#: "intermittent" is (intermittent_hits, intermittent_steps). See :func:`tune` for the rule.
TUNED: dict[str, tuple] = {"kl_k3_max": (0.1, 0.2, 0.5, 1.0, 2.0, 5.0), "lag_critical_factor": (2.0, 1.5),
                           "intermittent": ((2, 4), (3, 7), (4, 10)), "ess_min": (0.3, 0.2, 0.1)}


def replay(trace: dict, overrides: dict[str, float]) -> Outcome:
    """Run the Watch's alert listeners over a cached trace; returns the run's alert events."""
    from rlwatch.alerts.evaluator import AlertEvaluator
    from rlwatch.alerts.windows import AlertWindows
    from rlwatch.analyses.drift import DriftDetector
    from rlwatch.demo.scenario import collapse_step

    spec: RunSpec = trace["spec"]
    static = {"staleness_bound": {(): float(STALENESS_BOUND)}, "is_cap": {(): 2.0}}
    listeners = [DriftDetector(), AlertWindows(overrides, static)]
    evaluator = AlertEvaluator(spec.name, overrides=overrides, watchdog_interval=0, static=static)
    for step, raw in trace["steps"]:
        values = {k: dict(v) for k, v in raw.items() if not derived(k)}
        for listener in listeners:
            extra = listener.on_step(step, values)
            if extra:
                values.update(extra)
        evaluator.on_step(step, values)
    events = [Event(e.name, e.severity, e.state, int(e.step), dict(e.labels), e.value) for e in evaluator.events]
    # Ground truth of a hack run: the buggy grader's exploit took hold when, over some 10 consecutive
    # steps of the run (a whole window: not a last step or two, which no pager could see in time), at
    # least HACK_HOLD of the buggy environment's episodes got reward 1 while the true checker failed
    # them (what the verifier_disagreement detector counts, on every episode).
    hacked = [v.get("episodes_hacked_total", {}).get((spec.buggy_env, "verifier_disagreement"), 0.0)
              for _, v in trace["steps"]]
    judged = [v.get("episodes_judged_total", {}).get((spec.buggy_env, "verifier_disagreement"), 0.0)
              for _, v in trace["steps"]]
    took_hold = any(sum(judged[i:i + 10]) and sum(hacked[i:i + 10]) / sum(judged[i:i + 10]) >= HACK_HOLD
                    for i in range(max(1, len(hacked) - 9)))
    firing = sorted({e.name for e in evaluator.firing()})
    evaluator.close()
    return Outcome(run=spec.name, family=spec.family, scenario=spec.scenario, kind=spec.kind, seed=spec.seed,
                   steps=len(trace["steps"]), collapse_step=collapse_step(trace["heldout"]) if trace["heldout"]
                   else None, events=events, firing_at_end=firing, error=trace.get("error"),
                   hack_took_hold=spec.kind == "hack" and took_hold)


def exported_series(trace: dict, overrides: dict[str, float]) -> tuple[list[dict], list[set]]:
    """Per step: the window values a Watch would serve ({series text: value}) and the alerts the
    embedded evaluator has firing after that step ({(name, labels)})."""
    from rlwatch.alerts.catalogue import ALERT_LABELS
    from rlwatch.alerts.evaluator import AlertEvaluator
    from rlwatch.alerts.series import window_series
    from rlwatch.alerts.windows import AlertWindows
    from rlwatch.analyses.drift import DriftDetector

    static = {"staleness_bound": {(): float(STALENESS_BOUND)}, "is_cap": {(): 2.0}}
    drift, windows = DriftDetector(), AlertWindows(overrides, static)
    evaluator = AlertEvaluator("r", overrides=overrides, watchdog_interval=0, static=static)
    served, firing = [], []
    for step, raw in trace["steps"]:
        values = {k: dict(v) for k, v in raw.items() if not derived(k)}
        values.update(drift.on_step(step, values) or {})
        values.update(windows.on_step(step, values))
        evaluator.on_step(step, values)
        series = {'rlwatch_step{run="r"}': float(step)}
        for name, value in overrides.items():
            series[f'rlwatch_alert_threshold{{run="r",param="{name}"}}'] = value
        series.update(window_series(values, "r"))
        served.append(series)
        # The rules page per incident: an open alert carries its incident's ordinal.
        incident = {labels[:-2]: labels[-2] for labels in values["alert_incident"] if labels[-1] == "open"}
        firing.append({(e.name, tuple(sorted({**e.labels, "incident": incident.get(
            (e.name,) + tuple(e.labels.get(k, "") for k in ALERT_LABELS[1:]), "")}.items())))
            for e in evaluator.firing()})
    evaluator.close()
    return served, firing


def prometheus_agrees(traces: list[dict], overrides: dict[str, float], step_seconds: int = 10,
                      scrape: int = 5) -> dict[str, object]:
    """Replay each trace's exported window values through promtool (Prometheus' rule engine) with a
    step every ``step_seconds`` and compare the firing alerts with the embedded evaluator's at the
    last scrape of every step. Returns {"runs", "steps", "step_seconds", "ok", "promtool_tail"}."""
    from rlwatch.alerts import render
    from rlwatch.alerts.catalogue import ALERTS
    from rlwatch.alerts.series import step_series

    window_alerts = [a for a in ALERTS if a.condition is not None]
    rules = {"groups": [{"name": "rlwatch", "rules": [
        {"alert": a.name, "expr": a.expr, "for": "0m", "labels": {"severity": a.severity}} for a in window_alerts]}]}
    tests, steps_total = [], 0
    for trace in traces:
        served, firing = exported_series(trace, overrides)
        steps_total += len(served)
        series = step_series(served, step_seconds // scrape)
        for s in series:
            s["series"] = s["series"]
        cases = []
        for index, alerts in enumerate(firing):
            at = index * step_seconds + step_seconds - scrape
            for alert in window_alerts:
                expected = [{"exp_labels": {"severity": alert.severity, "run": "r", **dict(labels)}}
                            for name, labels in sorted(alerts) if name == alert.name]
                cases.append({"eval_time": f"{at}s", "alertname": alert.name, "exp_alerts": expected})
        tests.append({"name": trace["spec"].name, "interval": f"{scrape}s", "input_series": series,
                      "alert_rule_test": cases})
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "rules.yaml").write_text(render.to_yaml(rules))
        Path(directory, "tests.yaml").write_text(render.to_yaml({"rule_files": ["rules.yaml"],
                                                                 "evaluation_interval": f"{scrape}s",
                                                                 "tests": tests}))
        result = subprocess.run(["promtool", "test", "rules", "tests.yaml"], cwd=directory, capture_output=True,
                                text=True)
    return {"runs": len(traces), "steps": steps_total, "step_seconds": step_seconds, "ok": result.returncode == 0,
            "promtool_tail": (result.stdout + result.stderr)[-1500:] if result.returncode
            else ""}


def per_alert(outcomes: list[Outcome]) -> dict[str, dict[str, object]]:
    """Per alert: severity, firings on healthy runs, recall on the runs that collapsed (fired before the
    collapse) with its lead min / median, firings on each other kind of run, flaps per run."""
    from rlwatch.alerts.catalogue import ALERTS

    ok = [o for o in outcomes if o.error is None]
    collapsed = [o for o in ok if o.kind == "collapse" and o.collapse_step]
    kinds = sorted({kind for kind, _ in SCENARIOS.values()} - {"healthy"})
    table: dict[str, dict[str, object]] = {}
    for alert in ALERTS:
        if alert.condition is None:
            continue
        leads = []
        for o in collapsed:
            first = min((e.step for e in o.firings() if e.name == alert.name), default=None)
            if first is not None and first < o.collapse_step:
                leads.append(o.collapse_step - first)
        row: dict[str, object] = {
            "severity": alert.severity,
            "healthy": sum(1 for o in ok if o.kind == "healthy" for e in o.firings() if e.name == alert.name),
            "collapse recall": f"{len(leads)}/{len(collapsed)}",
            "lead min": min(leads) if leads else "-",
            "lead median": statistics.median(leads) if leads else "-",
        }
        for kind in kinds:
            row[kind] = sum(1 for o in ok if o.kind == kind for e in o.firings() if e.name == alert.name)
        flaps = sum(1 for o in ok for e in refirings(o) if e.name == alert.name)
        row["flaps per run"] = round(flaps / len(ok), 3) if ok else 0
        faulty = sum(row[kind] for kind in kinds)
        row["precision (faulty / all firings)"] = round(faulty / (faulty + row["healthy"]), 3) if faulty + row[
            "healthy"] else "-"
        table[alert.name] = row
    return table


def tune(traces: list[dict], base: dict[str, float]) -> tuple[dict[str, float], list[dict]]:
    """Choose TUNED's thresholds on the tuning traces. For each combination of the other thresholds
    (the catalogue's lag factor first, then the most sensitive intermittent window, then the largest
    ESS floor), the KL bounds of the grid that meet every bar; at the first combination with any, the
    feasible interval's two edges are found by bisection (in log space, to 5%) and the bound is their
    geometric midpoint: the same ratio of margin to the first healthy page below and to the first
    missed fault above. Else the quietest with the best recall."""
    tried: list[dict] = []
    others = (TUNED["lag_critical_factor"], TUNED["intermittent"], TUNED["ess_min"])
    for lag, (hits, steps), ess in itertools.product(*others):
        fixed = {**base, "lag_critical_factor": lag, "intermittent_hits": hits, "intermittent_steps": steps,
                 "ess_min": ess}
        grid = TUNED["kl_k3_max"]
        feasible = [kl for kl in grid if _meets_bars(traces, fixed, kl, tried)]
        if feasible:
            return {**fixed, "kl_k3_max": _midpoint(traces, fixed, grid, feasible, tried)}, tried
    quiet = [t for t in tried if t["healthy_critical_pages"] == 0] or tried
    best = max(quiet, key=lambda t: (t["collapsed_paged_before"] + t["intermittent_ok"], -t["flaps"]))
    return {**base, **{k: best[k] for k in TUNED_PARAMS}}, tried


def _meets_bars(traces: list[dict], fixed: dict[str, float], kl: float, tried: list[dict]) -> bool:
    """Replay ``traces`` at ``fixed`` with KL bound ``kl``; record the candidate in ``tried``."""
    overrides = {**fixed, "kl_k3_max": kl}
    s = score([replay(t, overrides) for t in traces])
    tried.append({**{k: overrides[k] for k in TUNED_PARAMS}, **{k: s[k] for k in (
        "healthy_critical_pages", "collapsed_paged_before", "collapsed", "lead_median", "intermittent_ok",
        "intermittent_runs", "flaps")}})
    return all(bars(s).values())


def _midpoint(traces: list[dict], fixed: dict[str, float], grid: tuple, feasible: list[float],
              tried: list[dict], resolution: float = 1.05) -> float:
    """The geometric midpoint of the feasible KL interval around the grid's ``feasible`` bounds, its
    edges bisected against the nearest infeasible grid bounds (an edge at the grid's end stays there);
    the median feasible grid bound (the lower of two) if the midpoint itself misses a bar."""
    def edge(good: float, bad: float | None) -> float:
        while bad is not None and max(good, bad) / min(good, bad) > resolution:
            middle = float(f"{(good * bad) ** 0.5:.3g}")
            if middle in (good, bad):
                break
            if _meets_bars(traces, fixed, middle, tried):
                good = middle
            else:
                bad = middle
        return good

    below = [kl for kl in grid if kl < feasible[0]]
    above = [kl for kl in grid if kl > feasible[-1]]
    low = edge(feasible[0], below[-1] if below else None)
    high = edge(feasible[-1], above[0] if above else None)
    middle = float(f"{(low * high) ** 0.5:.2g}")
    return middle if _meets_bars(traces, fixed, middle, tried) else feasible[(len(feasible) - 1) // 2]


# --- report -------------------------------------------------------------------------------------------

def _agreement(test_traces: list[dict], thresholds: dict[str, float], runs: int) -> dict:
    """prometheus_agrees on a sample of ``runs`` test runs at every cadence of the promtool tests."""
    from rlwatch.alerts.render import CADENCES

    usable = [t for t in test_traces if not t.get("error")]
    sample = usable[::max(1, len(usable) // max(1, runs))][:runs]
    cadences = [prometheus_agrees(sample, thresholds, seconds, scrape) for _, seconds, scrape in CADENCES]
    return {"runs": cadences[0]["runs"], "steps": cadences[0]["steps"],
            "step_seconds": ", ".join(str(c["step_seconds"]) for c in cadences),
            "ok": all(c["ok"] for c in cadences), "cadences": cadences}


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=".rlwatch-matrix", help="trace cache of evaluation.matrix")
    parser.add_argument("--out", help="write OUT.md and OUT.json")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--tuning-seeds", default=",".join(map(str, TUNING_SEEDS)))
    parser.add_argument("--test-seeds", default=",".join(map(str, TEST_SEEDS)))
    parser.add_argument("--steps", type=int, help="steps per run (default: each family's own)")
    parser.add_argument("--prometheus-sample", type=int, default=12, help="test runs replayed through promtool")
    parser.add_argument("--jobs", type=int, default=1, help="processes training traces missing from the cache")
    parser.add_argument("--worlds", default="real,toy", help="real (the real-scale family at the shipped "
                        "defaults), toy (the matrix at the toy-tuned config), or both; a world left out keeps "
                        "its part of an existing OUT.md / OUT.json")
    parser.add_argument("--real-cache", default=".rlwatch-realscale", help="trace cache of evaluation.realscale")
    return parser.parse_args(argv)


def _real_world(args: argparse.Namespace) -> bool:
    """The real-scale section at the head of OUT.md and under "real_scale" in OUT.json; True when every
    real-scale bar is met."""
    from .realscale_report import TOY_MARKER, run

    section, result = run(args.real_cache, args.jobs, prometheus_agrees=prometheus_agrees)
    print(section)
    if args.out:
        md, js = Path(args.out + ".md"), Path(args.out + ".json")
        old = md.read_text() if md.exists() else ""
        toy = old[old.index(TOY_MARKER):] if TOY_MARKER in old else TOY_MARKER + "\n" + old.split("\n", 1)[-1]
        head = "<!-- Written by `python -m evaluation.acceptance`. -->\n# Alert acceptance report: two worlds\n\n"
        md.write_text(head + section + "\n" + toy)
        data = json.loads(js.read_text()) if js.exists() else {}
        data["real_scale"] = {k: v for k, v in result.items() if k != "traces"}
        js.write_text(json.dumps(data, indent=1))
    return all(result["bars"].values()) and result["prometheus_agreement"].get("ok", False)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    worlds = set(args.worlds.split(","))
    real_ok = _real_world(args) if "real" in worlds else True
    if "toy" not in worlds:
        print("ACCEPTED" if real_ok else "NOT ACCEPTED")
        return 0 if real_ok else 1
    started = time.perf_counter()
    from rlwatch.demo import WATCH_CONFIG
    from .matrix import collect_all

    families, scenarios = tuple(args.families.split(",")), tuple(args.scenarios.split(","))
    seeds = [tuple(int(x) for x in text.split(",") if x) for text in (args.tuning_seeds, args.test_seeds)]
    tuning_specs, test_specs = (specs(s, families, scenarios, args.steps) for s in seeds)
    collect_all(tuning_specs + test_specs, args.cache, args.jobs)
    load = lambda spec: collect(spec, args.cache)  # noqa: E731 - cached
    base = {k: v for k, v in WATCH_CONFIG["alert_overrides"].items() if k not in TUNED_PARAMS}
    tuning_traces, test_traces = [load(s) for s in tuning_specs], [load(s) for s in test_specs]
    chosen, tried = tune(tuning_traces, base)
    outcomes = [replay(t, chosen) for t in test_traces]
    at = {"tuned": chosen, "shipped": {}}          # the catalogue's defaults: what a run gets with no override
    summaries = {"tuned": score(outcomes), "shipped": score([replay(t, {}) for t in test_traces])}
    checks = {name: bars(s) for name, s in summaries.items()}
    agreement = _agreement(test_traces, chosen, args.prometheus_sample) if args.prometheus_sample else {}
    ratio = {"tuning": [ratio_trial(tuning_traces, b, chosen, INTERMITTENT_STEPS) for b in RATIO_BOUNDS],
             "test": [ratio_trial(test_traces, b, chosen, INTERMITTENT_STEPS) for b in RATIO_BOUNDS]}
    seconds = time.perf_counter() - started
    command = "python -m evaluation.acceptance " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    split = {"families": families, "scenarios": scenarios, "tuning_seeds": seeds[0], "test_seeds": seeds[1],
             "tuning_runs": len(tuning_specs)}
    from .acceptance_report import markdown

    report = markdown(command, at, tried, summaries, checks, per_alert(outcomes), outcomes, agreement, seconds,
                      split, ratio)
    if args.out:
        from .realscale_report import TOY_MARKER

        md = Path(args.out + ".md")
        old = md.read_text() if md.exists() else ""
        real = old[old.index("## Real scale"):old.index(TOY_MARKER)] if TOY_MARKER in old and "## Real" in old else ""
        first, rest = report.split("\n", 1)
        toy = rest.replace("# Alert acceptance report", "## Toy world (the demo's policies, toy-tuned config)", 1)
        md.write_text(first + "\n# Alert acceptance report: two worlds\n\n" + real + TOY_MARKER + "\n" + toy)
        previous = json.loads(Path(args.out + ".json").read_text()) if Path(args.out + ".json").exists() else {}
        Path(args.out + ".json").write_text(json.dumps({"real_scale": previous.get("real_scale"),
            "command": command, "seconds": round(seconds), "thresholds": at, "tuning": tried,
            "summary": summaries, "bars": checks, "prometheus_agreement": agreement,
            "per_alert": per_alert(outcomes), "scale_free_trial": ratio,
            "runs": [asdict(o) | {"lead": o.lead, "flaps": o.flaps} for o in outcomes]}, indent=1))
    print(report)
    accepted = real_ok and all(checks["tuned"].values()) and agreement.get("ok", not args.prometheus_sample)
    print("ACCEPTED" if accepted else "NOT ACCEPTED")
    return 0 if accepted else 1


if __name__ == "__main__":
    raise SystemExit(main())
