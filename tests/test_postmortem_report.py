"""What the post-mortem and the live demo say, line by line: a cause named only where the run
suffered from it, the step an alert opened at, labels that tell two alerts apart, the comparison's
medians with the steps they cover, one number per hack rate, plural agreement."""

from __future__ import annotations

import statistics

from rlwatch.alerts.notify import AlertEvent
from rlwatch.demo import app
from rlwatch.postmortem import RunData, analyse, compare
from rlwatch.postmortem.report import (
    cause_line,
    change_line,
    comparison_lines,
    text_report,
)


def _event(name: str, step: int, labels: dict, state: str = "firing") -> AlertEvent:
    return AlertEvent(name, "warning", state, "r", step, labels, 0.5, "", "", "")


def test_live_view_says_the_step_the_alert_opened_and_which_one_it_is(capsys):
    view = app.LiveView("collapse", 100, None, enabled=False)
    opened = [_event("RLWatchMismatchDrift", 6, {"quantity": "kl_k3"}),
              _event("RLWatchMismatchDrift", 9, {"quantity": "abs_log_ratio_p99"})]
    for event in opened:
        view.alert(event)
    # What the evaluator's firing() holds later: the same alerts, their step moved to the latest one.
    later = [AlertEvent(e.name, e.severity, e.state, e.run, 99, e.labels, 0.7, "", "", "") for e in opened]
    view.update(99, {}, later)
    lines = [view.firing_line(e) for e in view.firing]
    assert any(line.endswith("since step 6") and "quantity=kl_k3" in line for line in lines), lines
    assert any(line.endswith("since step 9") and "quantity=abs_log_ratio_p99" in line for line in lines), lines
    printed = capsys.readouterr().out.splitlines()[-1]
    assert "firing now: MismatchDrift quantity=" in printed and "MismatchDrift, MismatchDrift" not in printed


def test_demo_summary_counts_one_critical_alert_in_the_singular(capsys):
    document = {"alerts": [{"name": "RLWatchVersionLagFarAboveBound", "severity": "critical", "step": 6}],
                "cause": "stale_weights", "resume": {}}
    app._print_summary(document, None, app.Path("d"), 1.0, None, None)
    out = capsys.readouterr().out
    assert "(1 critical alert)." in out and "alerts)" not in out


def _lag_run(name: str, lags: list[float]) -> RunData:
    data = RunData(run=name, source="memory")
    for step, lag in enumerate(lags):
        data.steps.append((step, {"version_lag_mean": {(): lag}, "version_lag_max": {(): lag},
                                  "reward_mean": {(): 0.5}}))
    return data


def test_comparison_gives_the_medians_with_the_steps_they_cover():
    """The good run's lag is 0; the bad run's climbs 1, 2, 3 ... from step 1: the line must not read
    as if the median after the change were the value at the step the change began."""
    bad = _lag_run("bad", [0.0] + [float(min(s, 8)) for s in range(1, 40)])
    good = _lag_run("good", [0.0] * 40)
    first = next(d for d in compare(bad, good).divergences if d.signal == "version_lag_mean")
    low, high = first.window
    stored = dict(bad.series("version_lag_mean"))
    assert first.bad == statistics.median(stored[s] for s in range(low, high + 1)) != stored[first.step]
    line = next(x for x in comparison_lines(compare(bad, good)) if "version_lag_mean" in x)
    assert f"from step {first.step:>5}" in line and f"(steps {low}..{high};" in line


def test_hack_rates_are_one_number_each_wherever_they_are_given():
    data = RunData(run="hack", source="memory")
    for step in range(40):
        rate = 0.02 if step < 5 else min(0.9, 0.05 * (step - 3))
        data.steps.append((step, {"env_hack_ratio": {("reverse", "verifier_disagreement"): rate},
                                  "mismatch_abs_log_ratio_mean": {(): 0.0}, "mismatch_log_ratio_mean": {(): 0.0},
                                  "reward_mean": {(): 0.5}}))
    report = analyse(data)
    change = next(c for c in report.first_signals if c.signal == "env_hack_ratio")
    before, after = f"{change.before:.1%}", f"{change.after:.1%}"
    assert report.evidence[0].startswith(f"hack rate of reverse / verifier_disagreement rose from {before} to {after}")
    assert f": {before} -> {after} (" in change_line(change)
    assert f"{before} -> {after} from step {change.step}" in text_report(report)


def _stale_run(alerts: list[dict]) -> RunData:
    """Lag 0 for two steps, then 4: the mismatch is 0 at lag 0 and 0.3 nats at lag 4, quality steady."""
    data = RunData(run="stale", source="memory")
    for step in range(30):
        lag = "0" if step < 2 else "4"
        level = 0.0 if lag == "0" else 0.3
        data.steps.append((step, {
            "mismatch_abs_log_ratio_mean": {(): level}, "mismatch_log_ratio_mean": {(): -level / 2},
            "mismatch_abs_log_ratio_mean_by_lag": {(lag,): level}, "mismatch_tokens_by_lag": {(lag,): 500.0},
            "version_lag_mean": {(): float(lag)}, "version_lag_max": {(): float(lag)},
            "trainer_version": {(): float(step)}, "reward_mean": {(): 0.5}}))
    data.alerts = alerts
    return data


def test_a_cause_is_named_only_where_the_run_suffered_from_it():
    quiet = analyse(_stale_run([]))
    assert quiet.diagnosis.causes == ["stale_weights"] and quiet.cause == "no cause found"
    assert cause_line(quiet) == "cause: no cause found (mismatch explained by stale_weights, below alert levels)"
    assert quiet.as_json()["mismatch_explanation"] == "mismatch explained by stale_weights, below alert levels"
    paged = analyse(_stale_run([{"name": "RLWatchVersionLagFarAboveBound", "severity": "critical", "step": 3,
                                 "state": "firing", "labels": {}}]))
    assert paged.cause == "stale_weights" and cause_line(paged).startswith("cause: stale_weights (")
    assert paged.as_json()["mismatch_explanation"] is None
