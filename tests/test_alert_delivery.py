"""One verdict at any scrape cadence: the training process and Prometheus' rule engine (promtool)
fire the same alerts, the same number of times, whether Prometheus scrapes every step or one step
in 200. A run with k3 bursts of 2 to 40 steps (some closer together than one scrape interval) is
computed by the process's own :class:`AlertWindows` and evaluator; what its exporter would serve
at each scrape is replayed through promtool with the generated rules, at every evaluation."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlwatch.alerts import render
from rlwatch.alerts.catalogue import ALERTS
from rlwatch.alerts.evaluator import AlertEvaluator
from rlwatch.alerts.model import ALERT_LABELS, INCIDENT_KEEP_FIRING_MINUTES
from rlwatch.alerts.windows import AlertWindows

from tests.conftest import need_binary

STEPS = 600                       # one step a second
AFTER = 240                       # seconds the final state is still served (the run goes on, healthy)
BURSTS = ((30, 8), (80, 3), (130, 2), (200, 40), (300, 2), (330, 2), (420, 5), (450, 2), (500, 8))
UNSEEN_SECONDS = 120              # INCIDENT_UNSEEN_WINDOW
KEEP_SECONDS = 60 * INCIDENT_KEEP_FIRING_MINUTES
LABELS = ALERT_LABELS + ("incident", "state")


def _k3(step: int) -> float:
    return 2.0 if any(start <= step < start + length for start, length in BURSTS) else 1e-4


def process_run() -> tuple[list[dict], list]:
    """(the alert_incident family after each step, the evaluator's firing events)."""
    clock = [0.0]
    windows = AlertWindows(clock=lambda: clock[0])
    evaluator = AlertEvaluator("r", watchdog_interval=0)
    served = []
    for step in range(STEPS):
        clock[0] = float(step)
        values = {"step": {(): float(step)}, "mismatch_kl_k3": {(): _k3(step)}}
        values.update(windows.on_step(step, values))
        evaluator.on_step(step, values)
        served.append(dict(values["alert_incident"]))
    evaluator.close()
    return served, [e for e in evaluator.events if e.state == "firing"]


def scrapes(served: list[dict], every: int) -> list[dict]:
    """What each scrape (one every ``every`` seconds, a step a second) shows."""
    return [served[min(t, STEPS - 1)] for t in range(0, STEPS + AFTER, every)]


def incident_states(shown: list[dict]) -> dict[tuple, list[str | None]]:
    """{incident (labels without state): its state at each scrape (None: absent)}."""
    out: dict[tuple, list[str | None]] = {}
    for j, family in enumerate(shown):
        for labels in family:
            out.setdefault(labels[:-1], [None] * len(shown))[j] = labels[-1]
    return out


def expected_firing(states: list[str | None], every: int, evaluation: int, end: int) -> list[bool]:
    """When the rules say this incident fires, at each evaluation (the rule, keep_firing_for)."""
    first = next(j for j, s in enumerate(states) if s) * every
    firing, last_true = [], None
    for t in range(0, end, evaluation):
        j = t // every
        state = states[j] if j < len(states) else None
        seen_open = "open" in states[:j + 1]
        raw = state == "open" or (state == "resolved" and first > t - UNSEEN_SECONDS and not seen_open)
        if raw:
            last_true = t
        firing.append(raw or (last_true is not None and t - (last_true + evaluation) < KEEP_SECONDS))
    return firing


def _series(shown: list[dict]) -> list[dict]:
    out = []
    for labels in dict.fromkeys(k for family in shown for k in family):
        named = ",".join(f'{k}="{v}"' for k, v in zip(LABELS, labels) if v != "")
        values, seen = [], False
        for family in shown:
            if labels in family:
                values.append(f"{family[labels]:.10g}")
                seen = True
            else:
                values.append("stale" if seen and values and values[-1] != "stale" else "_")
                seen = seen and values[-1] != "stale"
        out.append({"series": f'rlwatch_alert_incident{{run="r",{named}}}', "values": " ".join(values)})
    return out


def _alert_labels(incident: tuple) -> dict:
    named = {k: v for k, v in zip(LABELS[1:], incident[1:]) if v != ""}
    return {"severity": next(a.severity for a in ALERTS if a.name == incident[0]), "run": "r", **named}


@pytest.mark.parametrize("every", [1, 7, 50, 200])
def test_process_and_prometheus_fire_the_same_alerts_the_same_number_of_times(every, tmp_path: Path):
    promtool = need_binary("promtool")
    served, events = process_run()
    shown = scrapes(served, every)
    incidents = incident_states(shown)
    evaluation = min(every, 10)
    end = STEPS + AFTER
    # The process: one incident per firing event, each alert and label set counted alike.
    per_key: dict = {}
    for event in events:
        key = (event.name,) + tuple(event.labels.get(k, "") for k in ALERT_LABELS[1:])
        per_key[key] = per_key.get(key, 0) + 1
    assert {k: per_key[k] for k in sorted(per_key)} == {
        k: sum(1 for i in incidents if i[:-1] == k) for k in sorted(per_key)}
    assert per_key[("RLWatchKLSpike", "", "", "", "")] == len(BURSTS)
    # Every incident fires in one unbroken stretch, and the rule engine agrees at every evaluation.
    timeline = {i: expected_firing(states, every, evaluation, end) for i, states in incidents.items()}
    for incident, firing in timeline.items():
        starts = sum(1 for a, b in zip([False] + firing, firing) if b and not a)
        assert starts == 1 and not firing[-1], (incident, every)      # fires once, then resolves
    names = sorted({i[0] for i in incidents})
    cases = [{"eval_time": f"{t}s", "alertname": name,
              "exp_alerts": [{"exp_labels": _alert_labels(i)} for i, firing in timeline.items()
                             if i[0] == name and firing[n]]}
             for n, t in enumerate(range(0, end, evaluation)) for name in names]
    rules = {"groups": [{"name": "rlwatch", "rules": [
        {"alert": a.name, "expr": a.expr, "for": "0m", "keep_firing_for": f"{a.keep_firing}m",
         "labels": {"severity": a.severity}} for a in ALERTS if a.name in names]}]}
    (tmp_path / "rules.yaml").write_text(render.to_yaml(rules))
    (tmp_path / "tests.yaml").write_text(render.to_yaml({
        "rule_files": ["rules.yaml"], "evaluation_interval": f"{evaluation}s",
        "tests": [{"interval": f"{every}s", "input_series": _series(shown), "alert_rule_test": cases}]}))
    result = subprocess.run([promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    if every == 200:               # the hard case: several incidents opened and resolved within one scrape
        unseen = [i for i, states in incidents.items() if "open" not in states]
        assert len(unseen) >= len(BURSTS) - 3


def _spike(watch, steps: range, r: float) -> None:
    for step in steps:
        watch.observe(step, mask=[[1] * 8] * 4, sampler_logp=[[-1.0] * 8] * 4, trainer_logp=[[-1.0 + r] * 8] * 4)


def test_close_serves_an_unseen_incident_to_one_more_scrape():
    """A run that ends right after an incident opened: close() keeps /metrics up until a scrape has
    shown it (bounded by the measured scrape interval), and does not wait when nothing scrapes."""
    import threading
    import time
    import urllib.request

    from rlwatch import Watch

    with Watch(run="last", port=0, store=None, alerts=False) as idle:
        _spike(idle, range(3), 1.5)
        start = time.monotonic()
    assert time.monotonic() - start < 2                       # never scraped: nothing to wait for

    watch = Watch(run="last", port=0, store=None, alerts=False)
    _spike(watch, range(3), 0.01)
    for _ in range(2):                                         # a scraper every ~0.5 s
        urllib.request.urlopen(watch.url, timeout=5).read()
        time.sleep(0.5)
    _spike(watch, range(3, 6), 1.5)                            # KLSpike opens after the last scrape
    closer = threading.Thread(target=watch.close)
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive()                                   # waiting for the scrape
    body = urllib.request.urlopen(watch.url, timeout=5).read().decode()
    closer.join(timeout=5)
    assert not closer.is_alive()
    assert 'alert="RLWatchKLSpike"' in body and 'state="open"' in body and 'incident="1"' in body


def test_the_store_records_the_run_instance(tmp_path: Path):
    from rlwatch import Watch
    from rlwatch.runs.store_reader import StoreReader

    with Watch(run="stored", port=None, store=str(tmp_path / "s.db")) as watch:
        _spike(watch, range(2), 0.01)
    with StoreReader(str(tmp_path / "s.db")) as reader:
        assert reader.meta("stored")["run_instance"] == watch.run_instance
