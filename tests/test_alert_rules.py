"""The alert catalogue: generated files up to date, promtool-valid, and the embedded evaluator
firing on the same series at the same step as the rules."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from rlwatch.core import metrics
from rlwatch.alerts import render
from rlwatch.alerts.catalogue import ALERTS, BY_NAME, History, StepExample, stalled, thresholds, wilson_lower
from rlwatch.alerts.evaluator import AlertEvaluator
from rlwatch.alerts.notify import AlertEvent, Dispatcher, SlackNotifier, WebhookNotifier, redact

from tests.conftest import ROOT, need_binary

ALERTS_DIR = ROOT / "alerts"


def test_checked_in_files_match_the_catalogue():
    assert render.check(ALERTS_DIR) == [], "run: python -m rlwatch.alerts.render"


@pytest.mark.parametrize("tests_file", [render.TESTS_FILE, *render.CADENCE_TESTS_FILES.values()])
def test_promtool_checks_and_unit_tests_pass(tests_file):
    """The rules fire every step-window example at the same step with a step every 1 s, 10 s and 10 min."""
    promtool = need_binary("promtool")
    check = subprocess.run([promtool, "check", "rules", str(ALERTS_DIR / render.RULES_FILE)], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", tests_file], cwd=ALERTS_DIR, capture_output=True,
                          text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout


def test_alertmanager_example_is_valid():
    amtool = need_binary("amtool")
    result = subprocess.run([amtool, "check-config", str(ALERTS_DIR / render.ALERTMANAGER_FILE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_an_example_a_runbook_section_and_known_metrics():
    runbook = (ALERTS_DIR / render.RUNBOOK_FILE).read_text()
    exported = metrics.exported_names()
    recorded = {name for name, _ in render.RECORDING_RULES}
    assert "## Paging policy" in runbook
    for alert in ALERTS:
        assert alert.example is not None, alert.name
        assert f"## {alert.name}" in runbook
        assert alert.severity in ("critical", "warning", "none")
        assert (alert.condition is None) != isinstance(alert.example, StepExample), alert.name
        for name in re.findall(r"\b(rlwatch_[a-z0-9_]+|[a-z_]+:rlwatch_[a-z0-9_]+:[a-z0-9_]+)\b", alert.expr):
            assert name in exported or name in recorded, (alert.name, name)
    for _, expr in render.RECORDING_RULES:
        for name in re.findall(r"\brlwatch_[a-z0-9_]+\b", expr):
            assert name in exported, name


def _parse_series(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition("{")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return name, labels


def example_steps(alert) -> list[tuple[int, dict]]:
    """The example's series as one step per minute of rlwatch values (counters as increments)."""
    example = alert.example
    length = max(len(v) for v in example.series.values())
    steps = [(minute, {}) for minute in range(length)]
    for text, values in example.series.items():
        name, labels = _parse_series(text)
        if not name.startswith("rlwatch_"):
            continue
        spec = metrics.BY_NAME[name[len("rlwatch_"):]]
        key = tuple(labels.get(label, "") for label in spec.labels)
        previous = 0.0
        for minute, value in enumerate(values):
            if value is None:
                continue
            stored = value - previous if spec.kind == "counter" else value
            previous = value
            steps[minute][1].setdefault(spec.name, {})[key] = stored
    return steps


@pytest.mark.parametrize("alert,example", [(a, e) for a in ALERTS if a.condition is not None for e in a.examples],
                         ids=lambda x: getattr(x, "name", None) or getattr(x, "case", "") or "example")
def test_embedded_evaluator_fires_at_the_same_step_as_the_rules(alert, example):
    evaluator = AlertEvaluator("r1", alerts=[alert], watchdog_interval=0)
    fired_at = None
    for step, values in example.steps():
        evaluator.on_step(step, values)
        if evaluator.firing() and fired_at is None:
            fired_at = step
            event = evaluator.firing()[0]
            assert event.labels == example.labels
            assert event.value == pytest.approx(example.value, rel=1e-3)
            assert "{{" not in event.description and "r1" in event.description
    evaluator.close()
    assert fired_at == example.fires_at, f"{alert.name}: embedded fired at {fired_at}, rules at {example.fires_at}"


def test_stalled_watchdog_matches_the_rule():
    alert = BY_NAME["RLWatchTrainerStalled"]
    steps = example_steps(alert)
    history = History(steps[:1], thresholds())
    # The rule's example: last step at t=0, no new step; it fires when time() passes 900 s.
    assert stalled(history, now=15 * 60) == []
    assert stalled(history, now=16 * 60) == [({}, 960.0)]
    evaluator = AlertEvaluator("r1", watchdog_interval=0, clock=lambda: 16 * 60.0)
    evaluator.on_step(0, steps[0][1])
    evaluator.check_stalled()
    assert [e.name for e in evaluator.firing()] == ["RLWatchTrainerStalled"]
    evaluator.close()


def test_threshold_overrides_apply_and_are_exported():
    alert = BY_NAME["RLWatchKLSpike"]
    evaluator = AlertEvaluator("r1", overrides={"kl_k3_max": 0.001}, watchdog_interval=0)
    for step in range(alert.for_steps):
        evaluator.on_step(step, {"mismatch_kl_k3": {(): 0.002}, "step": {(): float(step)}})
    assert [e.name for e in evaluator.firing()] == [alert.name]
    evaluator.close()
    from rlwatch import Watch

    with Watch(run="o", port=None, store=None, alerts=False, alert_overrides={"kl_k3_max": 0.5}) as w:
        snap = w.state.snapshot()
    assert snap.gauges["alert_threshold"][("kl_k3_max",)] == 0.5
    assert snap.gauges["alert_threshold"][("ess_min",)] == 0.3


@pytest.mark.parametrize("overrides, message", [
    ({"clear_steps": float("nan")}, "'clear_steps'=nan is not allowed: clear_steps must be a number in [1, inf)"),
    ({"clear_steps": -1}, "'clear_steps'=-1 is not allowed: clear_steps must be a number in [1, inf)"),
    ({"kl_k3_max": 0}, "kl_k3_max must be a number in (0, inf)"),
    ({"ess_min": 1.5}, "ess_min must be a number in [0, 1]"),
    ({"stall_seconds": "soon"}, "stall_seconds must be a number in (0, inf)"),
    ({"hold_fraction": None}, "hold_fraction must be a number in (0, 1]"),
    ({"kl_k3_mx": 0.5}, "unknown alert threshold 'kl_k3_mx' (known: kl_k3_max, "),
    ({"intermittent_hits": 8}, "intermittent_hits must be in [1, intermittent_steps="),
])
def test_invalid_threshold_overrides_are_refused_when_the_watch_is_built(overrides, message, tmp_path):
    """NaN, out-of-range values, non-numbers and unknown names raise ValueError naming the parameter
    and its range (on main: a NaN clear_steps was taken and silenced a 30-step spike, a misspelt name
    was logged and ignored); `render --overrides` refuses the same values in a Prometheus-side file."""
    from rlwatch import Watch

    with pytest.raises(ValueError) as raised:
        Watch(run="o", port=None, store=None, alerts=True, alert_overrides=overrides)
    assert message in str(raised.value)
    (name, value), = overrides.items()
    rule = (f'label_replace(label_replace(vector({value}), "run", "r2", "", ""), "param", "{name}", "", "")'
            .replace("nan", "NaN"))
    path = tmp_path / "overrides.yaml"
    path.write_text(render.to_yaml({"groups": [{"name": "o", "rules": [{"record": "rlwatch_alert_threshold",
                                                                         "expr": rule}]}]}))
    if isinstance(value, (int, float)):
        assert render.main(["--overrides", str(path)]) == 1
    assert render.main(["--overrides", str(ALERTS_DIR / render.OVERRIDES_FILE)]) == 0


def test_one_incident_one_page_and_resolved_carries_the_current_value():
    """A spike that dips below the bound for a few steps stays one incident; it resolves clear_steps
    steps after its hold condition last held, with the value of that step; the guard runs once."""
    seen = []
    evaluator = AlertEvaluator("r1", guard=[seen.append], watchdog_interval=0)
    k3 = [0.5, 0.5, 0.01, 0.01, 0.5, 0.06] + [0.001] * 17
    for step, value in enumerate(k3):
        evaluator.on_step(step, {"mismatch_kl_k3": {(): value}})
    states = [(e.name, e.state, e.step, e.value) for e in evaluator.events]
    # opens at step 1 (2 steps above 0.1); 0.06 > 0.5 x 0.1 holds at step 5; quiet from step 6; 15 quiet steps
    assert states == [("RLWatchKLSpike", "firing", 1, 0.5), ("RLWatchKLSpike", "resolved", 20, 0.001)]
    evaluator.close()                                         # waits for the guard's thread
    assert [e.name for e in seen] == ["RLWatchKLSpike"]      # once, on firing


def test_evidence_before_alarm():
    """3 of 40 flagged is not evidence of a rate above 5%; 30 of 40 is. A hack rate with no history
    before its window never opens the critical alert; one that keeps climbing keeps it open."""
    assert wilson_lower(3, 40, 2.33) < 0.05 < wilson_lower(30, 40, 2.33)
    alert = BY_NAME["RLWatchRewardHackRateRising"]
    evaluator = AlertEvaluator("r1", alerts=[alert], watchdog_interval=0)
    key = ("buggy", "verifier")
    for step in range(8):           # hacked from the first step: no baseline, no page
        evaluator.on_step(step, {"episodes_hacked_total": {key: 20.0}, "episodes_judged_total": {key: 40.0}})
    assert evaluator.firing() == []
    evaluator.close()
    evaluator = AlertEvaluator("r1", alerts=[alert], watchdog_interval=0)
    hacked = [0.0] * 15 + [4.0 * i for i in range(1, 10)] + [36.0] * 40      # climbs to 90% and stays
    for step, k in enumerate(hacked):
        evaluator.on_step(step, {"episodes_hacked_total": {key: k}, "episodes_judged_total": {key: 40.0}})
    events = [(e.state, e.step) for e in evaluator.events]
    assert len(events) == 1 and events[0][0] == "firing", events       # opened once, still firing at 90%
    assert evaluator.firing()[0].value == pytest.approx(0.9)
    evaluator.close()


def test_a_smooth_kl_rise_below_the_bound_never_pages():
    """The independent runs' healthy lag-2 pattern: k3 rising from 0.002 to 0.09 over 80 steps with
    small-batch noise, never reaching the 0.1 bound. The old relative branch (k3 > 5x its trailing
    mean above a 0.01 floor) paged it 3 times; now the absolute bound never pages it. A climb to 45x the
    run's own baseline is a departure (RLWatchKLDeparture pages it once, docs/real-scale.md)."""
    import random

    rng = random.Random(0)
    k3 = [min(0.002 * 45 ** (step / 79) * rng.lognormvariate(0, 0.6), 0.095) for step in range(80)]
    old = [s for s in range(80) if (base := k3[max(0, s - 35):max(0, s - 4)]) and k3[s] > 0.01
           and k3[s] > 5 * sum(base) / len(base)]
    assert len(old) == 3                       # the series is one the old rule paged
    evaluator = AlertEvaluator("r1", watchdog_interval=0)
    for step, value in enumerate(k3):
        evaluator.on_step(step, {"mismatch_kl_k3": {(): value}, "step": {(): float(step)}})
    assert [e.name for e in evaluator.events if e.severity == "critical"] == ["RLWatchKLDeparture"]
    assert len([e for e in evaluator.events if e.state == "firing" and e.name != "RLWatchKLDeparture"]) <= 1
    evaluator.close()


@pytest.mark.parametrize("every", [2, 3, 8])
def test_an_intermittent_kl_fault_pages_within_10_steps_and_keeps_one_incident(every):
    """k3 at 8x the bound on every second or third step for 60 steps (one replica of several with a
    sampler fault) opens the critical KLSpike within 10 steps of the first spike, once, and the Watch
    exports the raise steps of the window that opened it; a lone spike every 8 steps never pages."""
    from rlwatch.alerts.windows import AlertWindows

    windows = AlertWindows()
    evaluator = AlertEvaluator("r1", watchdog_interval=0)
    start, opened_with = 20, None
    for step in range(start + 60):
        spike = step >= start and (step - start) % every == 0
        values = {"mismatch_kl_k3": {(): 0.8 if spike else 0.004}, "step": {(): float(step)}}
        exported = windows.on_step(step, values)
        evaluator.on_step(step, {**values, **exported})
        if opened_with is None and evaluator.firing():
            opened_with = exported["alert_hit_steps"][("RLWatchKLSpike", "", "", "", "")]
    critical = [(e.name, e.state, e.step) for e in evaluator.events if e.severity == "critical"]
    evaluator.close()
    if every == 8:
        assert critical == []
        return
    assert len(critical) == 1 and critical[0][:2] == ("RLWatchKLSpike", "firing"), critical
    assert critical[0][2] - start < 10
    assert opened_with == windows.params["intermittent_hits"]


def test_onpolicy_fault_keeps_firing_after_the_first_steps():
    """A temperature fault found at step 0 keeps its critical alert for as long as the offset lasts."""
    evaluator = AlertEvaluator("r1", watchdog_interval=0)
    for step in range(30):
        evaluator.on_step(step, {"mismatch_log_ratio_mean": {(): -0.08}, "mismatch_kl_k2": {(): 0.01},
                                 "mismatch_tokens": {(): 2000.0}, "version_lag_max": {(): 0.0},
                                 "step": {(): float(step)}})
    assert [(e.name, e.state, e.step) for e in evaluator.events] == [("RLWatchOnPolicyRatioNotOne", "firing", 0)]
    evaluator.close()


def test_watch_exports_the_window_statistics_the_evaluator_reads():
    """One verdict: the Watch exports alert_quiet_steps/alert_value, and the evaluator fires exactly
    the alerts whose exported quiet steps are below clear_steps."""
    from rlwatch import Watch

    with Watch(run="w", port=None, store=None, alerts=True, staleness_bound=2) as w:
        for step in range(3):
            w.observe(step, mask=[[1, 1]], seq_version=[step], trainer_version=step + 9)
        snap = w.state.snapshot()
        firing = {e.name for e in w.evaluator.firing()}
    quiet = snap.gauges["alert_quiet_steps"]
    exported = {labels[0] for labels, q in quiet.items() if q < 10}
    assert exported == firing and "RLWatchVersionLagFarAboveBound" in firing
    assert snap.gauges["alert_value"][("RLWatchVersionLagFarAboveBound", "", "", "", "")] == 9.0


class _Receiver(BaseHTTPRequestHandler):
    bodies: list = []
    delay = 0.0

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.delay)
        type(self).bodies.append((self.path, json.loads(body)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    class Handler(_Receiver):
        bodies = []
        delay = 0.0
    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, Handler
    server.shutdown()


def _event(state="firing", value=0.3, name="RLWatchKLSpike", when=None):
    alert = BY_NAME[name]
    return AlertEvent(name, alert.severity, state, "r1", 7, {}, value, alert.summary, "desc", alert.runbook_url,
                      time=when or time.time())


def test_webhook_and_slack_notifiers_deliver_deduplicated(receiver):
    server, handler = receiver
    base = f"http://127.0.0.1:{server.server_address[1]}"
    errors = []
    dispatcher = Dispatcher([WebhookNotifier(base + "/hook/SECRET-TOKEN"), SlackNotifier(base + "/slack/T000/B000")],
                            lambda kind, msg: errors.append((kind, msg)))
    dispatcher.submit(_event())
    dispatcher.submit(_event())                 # duplicate: same alert, same state
    dispatcher.submit(_event(state="resolved"))
    dispatcher.flush()
    dispatcher.close()
    paths = [p for p, _ in handler.bodies]
    assert paths.count("/hook/SECRET-TOKEN") >= 1 and paths.count("/slack/T000/B000") >= 1
    alerts = [a for p, b in handler.bodies if p.startswith("/hook") for a in b["alerts"]]
    assert [a["status"] for a in alerts] == ["firing", "resolved"]
    assert alerts[0]["annotations"]["runbook_url"].endswith("#rlwatchklspike")
    assert alerts[0]["values"]["value"] == 0.3 and alerts[0]["labels"]["severity"] == "critical"
    slack = [b for p, b in handler.bodies if p.startswith("/slack")]
    assert "RLWatchKLSpike" in slack[0]["text"] and "runbook" in slack[0]["text"]
    assert not errors


def test_a_hanging_or_down_receiver_never_blocks_and_never_leaks_the_url(receiver, caplog, tmp_path):
    caplog.set_level(logging.DEBUG, logger="rlwatch")
    server, handler = receiver
    handler.delay = 3.0
    url = f"http://127.0.0.1:{server.server_address[1]}/services/T0/B0/xoxb-SECRET"
    from rlwatch import Watch
    from rlwatch.runs.store import StoreReader

    with Watch(run="slow", port=None, store=str(tmp_path / "s.db"), alerts=True,
               notifiers=(WebhookNotifier(url, timeout=0.5), WebhookNotifier("http://127.0.0.1:1/x/SECRET2"))) as w:
        start = time.perf_counter()
        for step in range(3):
            w.observe(step, mask=[[1, 1]], sampler_logp=[[-1.0, -1.0]], trainer_logp=[[0.5, 0.5]])
        assert time.perf_counter() - start < 1.0      # the training thread never waits for the receivers
        evaluator = w.evaluator
        evaluator.dispatcher.flush(timeout=10)
        w.flush()
    assert w.errors.counts[("notify", "send")] >= 2
    text = caplog.text + "".join(str(r) for r in caplog.records)
    with StoreReader(str(tmp_path / "s.db")) as store:
        dump = json.dumps([store.alerts("slow"), store.events("slow"), store.meta("slow")])
    for secret in ("SECRET", "xoxb"):
        assert secret not in text and secret not in dump
    assert redact(url) == f"http://127.0.0.1:{server.server_address[1]}/…"
    assert "RLWatchKLSpike" in [a["name"] for a in json.loads(dump)[0]]


def test_rate_limit_drops_and_counts():
    sent = []

    class Fake:
        name = "fake"

        def send(self, events):
            sent.extend(events)

    errors = []
    dispatcher = Dispatcher([Fake()], lambda kind, msg: errors.append(kind), max_per_minute=2)
    for i in range(5):
        dispatcher.submit(_event(name="RLWatchKLSpike", value=i, state="firing" if i % 2 == 0 else "resolved"))
        dispatcher.flush()
    dispatcher.close()
    assert len(sent) == 2 and errors.count("rate_limited") == 3


def test_watch_evaluator_knows_the_staleness_bound():
    from rlwatch import Watch

    with Watch(run="lag", port=None, store=None, alerts=True, staleness_bound=2) as w:
        for step in range(BY_NAME["RLWatchVersionLagFarAboveBound"].for_steps):
            w.observe(step, mask=[[1, 1]], seq_version=[step], trainer_version=step + 9)
        names = [e.name for e in w.evaluator.firing()]
    assert "RLWatchVersionLagFarAboveBound" in names                 # lag 9 > 2 x bound 2


def test_prometheus_side_override_file_takes_effect(tmp_path):
    """The shipped override file (stall_seconds 3600 for run my-run) wins over the 900 s the process
    exports, for every process of that run name; another run keeps the exported value."""
    import yaml

    promtool = need_binary("promtool")
    idle = "0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0"
    series = []
    for run, instance in (("my-run", "a"), ("my-run", "b"), ("other", "c")):
        labels = f'run="{run}",run_instance="{instance}"'
        series += [{"series": f"rlwatch_last_step_timestamp_seconds{{{labels}}}", "values": idle},
                   {"series": f"rlwatch_step{{{labels}}}", "values": idle},
                   {"series": f'rlwatch_alert_threshold{{{labels},param="stall_seconds"}}', "values": "900x20"}]

    def firing(*runs):
        return [{"exp_labels": {"severity": "critical", "run": run, "run_instance": instance},
                 "exp_annotations": {"summary": "The trainer has not finished a step for too long.",
                                     "description": f"Run {run}: no step for 16m 0s.",
                                     "runbook_url": "http://127.0.0.1:9400/runbook#rlwatchtrainerstalled"}}
                for run, instance in runs]
    case = {"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": "16m", "alertname": "RLWatchTrainerStalled", "exp_alerts": firing(("other", "c"))}]}
    tests = {"rule_files": [str(ALERTS_DIR / render.RULES_FILE), str(ALERTS_DIR / render.OVERRIDES_FILE)],
             "evaluation_interval": "1m", "tests": [case]}
    path = tmp_path / "overrides.test.yaml"
    path.write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # Without the override file, both processes of my-run page at 16 min as well.
    tests["rule_files"] = tests["rule_files"][:1]
    case["alert_rule_test"][0]["exp_alerts"] = firing(("my-run", "a"), ("my-run", "b"), ("other", "c"))
    path.write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_one_runs_duplicate_series_never_stop_another_runs_stall_alert(tmp_path):
    """Two live processes export run "dup" under one run_instance (two targets, one identity): the
    shipped rule still pages for the stalled run "victim" at 16 min, and for the stalled one of the
    two duplicates (told apart by their `instance`), not for the one still stepping."""
    import yaml

    promtool = need_binary("promtool")
    idle, stepping = "0x19", "0+60x19"            # last step at t=0 / a step every minute
    processes = (("victim", "v", "127.0.0.1:1", idle), ("dup", "same", "127.0.0.1:2", idle),
                 ("dup", "same", "127.0.0.1:3", stepping))
    series = []
    for run, run_instance, target, values in processes:
        labels = f'job="rlwatch",instance="{target}",run="{run}",run_instance="{run_instance}"'
        series += [{"series": f"rlwatch_last_step_timestamp_seconds{{{labels}}}", "values": values},
                   {"series": f"rlwatch_step{{{labels}}}", "values": "0x19"},
                   {"series": f'rlwatch_alert_threshold{{{labels},param="stall_seconds"}}', "values": "900x19"}]

    def firing(*which):
        return [{"exp_labels": {"severity": "critical", "job": "rlwatch", "instance": target, "run": run,
                                "run_instance": run_instance},
                 "exp_annotations": {"summary": "The trainer has not finished a step for too long.",
                                     "description": f"Run {run}: no step for 16m 0s.",
                                     "runbook_url": "http://127.0.0.1:9400/runbook#rlwatchtrainerstalled"}}
                for run, run_instance, target, _ in which]
    tests = {"rule_files": [str(ALERTS_DIR / render.RULES_FILE), str(ALERTS_DIR / render.OVERRIDES_FILE)],
             "evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
                 {"eval_time": "15m", "alertname": "RLWatchTrainerStalled", "exp_alerts": []},
                 {"eval_time": "16m", "alertname": "RLWatchTrainerStalled",
                  "exp_alerts": firing(processes[0], processes[1])}]}]}
    path = tmp_path / "duplicates.test.yaml"
    path.write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
