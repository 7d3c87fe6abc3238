"""`rlwatch demo`, the README's main job, as a user runs it: a real subprocess, a real tiny RL run
that collapses, the live signals, the post-mortem at the end; and `--with-prometheus` against a
real local Prometheus and Alertmanager that the demo starts and stops."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port, need_binary

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _stop_the_demos_servers(tmp_path: Path):
    """Whatever happened (the demo timed out and was killed, failed, or left its servers running),
    stop by PID the Prometheus and Alertmanager it started in their own sessions, after the test's
    own assertions (one of them is that the demo stopped them itself)."""
    from rlwatch.runs.stack import down

    yield
    for pids in sorted(tmp_path.glob("demo/*/stack/pids.json")):
        down(pids.parent)


def demo(tmp_path: Path, *args: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the demo from ``tmp_path`` with a relative --out, as a user runs it from a checkout."""
    out = tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "rlwatch", "demo", "--no-live", "--port", str(free_port()),
                             "--out", "demo", *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return result, json.loads((run_dir / "report" / "postmortem.json").read_text()) | {
        "demo": json.loads((run_dir / "demo.json").read_text())}


def test_demo_pages_before_the_collapse_and_explains_it(tmp_path):
    result, doc = demo(tmp_path)
    text = result.stdout
    lead = re.search(r"The critical alert (\w+) fired at step (\d+), (\d+) steps before the collapse "
                     r"\(held-out reward lost at step (\d+)[;)]", text)
    assert lead, text[-3000:]
    name, fired, steps_before, collapse = lead.group(1), *map(int, lead.groups()[1:])
    assert collapse - fired == steps_before > 0
    assert doc["demo"]["collapse_step"] == collapse and name.startswith("RLWatch")
    # The headline is the stored held-out reward's first sustained drop, whatever it did afterwards.
    from rlwatch.postmortem import load

    from tests.test_collapse_dating import first_sustained_drop
    stored = load(str(tmp_path / doc["demo"]["directory"] / "run.db")).scalars["heldout_true_reward"]
    assert abs(collapse - first_sustained_drop(sorted(stored))) <= 3, (collapse, sorted(stored))
    assert f"collapsed at step {collapse}" in text
    assert "Cause: stale_weights." in text and doc["cause"] == "stale_weights"
    resume = doc["resume"]                                # the lag was there from the first steps:
    assert resume["trouble_step"] <= fired and resume["checkpoint"] is None   # no checkpoint predates it
    path = Path(resume["fallback"]["path"])               # stored absolute: found from any directory
    assert resume["fallback"]["step"] < doc["collapse_step"] and path.is_absolute() and path.is_dir()
    assert (path / "model.safetensors").exists()
    report = tmp_path / doc["demo"]["directory"] / "report"     # the demo's --out was relative
    assert (report / "postmortem.md").exists() and (report / "mismatch_kl_k3.png").stat().st_size > 0
    assert re.search(r"step\s+0 \[healthy\]", text)                       # the progress lines
    assert "FIRING RLWatchVersionLagFarAboveBound (critical)" in text      # alerts as they fire
    assert "firing now: " in text and "VersionLagFarAboveBound" in text.split("firing now: ")[-1]
    # One incident, one page, one line: no alert opens again within 10 steps of resolving (no flap),
    # and each transition is printed once.
    resolved: dict = {}
    for a in sorted(doc["alerts"], key=lambda a: a["step"]):
        key = (a["name"], json.dumps(a.get("labels") or {}, sort_keys=True))
        if a["state"] == "resolved":
            resolved[key] = a["step"]
        else:
            assert key not in resolved or a["step"] - resolved[key] > 10, (key, a["step"], resolved[key])
    for name in {a["name"] for a in doc["alerts"]}:
        count = sum(a["name"] == name and a["state"] == "firing" for a in doc["alerts"])
        assert text.count(f"FIRING {name} (") == count, name


def test_demo_refuses_an_unknown_scenario(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlwatch", "demo", "--scenario", "nope", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "unknown scenario 'nope'" in result.stderr


@pytest.mark.servers
def test_demo_with_prometheus_and_alertmanager(tmp_path):
    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    result, doc = demo(tmp_path, "--with-prometheus")
    fired = doc["demo"]["prometheus_alerts"]
    assert "RLWatchVersionLagFarAboveBound" in fired, result.stdout[-2000:]
    # One verdict: the real Prometheus, scraping the run's exported step windows with the shipped
    # rules, fired exactly the alerts the in-process evaluator fired.
    in_process = {a["name"] for a in doc["alerts"] if a["state"] == "firing"}
    assert set(fired) == in_process, (fired, in_process)
    assert "RLWatchVersionLagFarAboveBound" in doc["demo"]["alertmanager_alerts"]
    notified = doc["demo"]["alertmanager_notifications"]        # every notification, in order, per alert
    assert all(notes[0][1] == "firing" and set(fired) >= {name} for name, notes in notified.items()), notified
    # Resolutions included: every notified alert resolved once the run ended, and KLSpike, which
    # resolved in the process and fired again (a new incident), was notified twice each way.
    notified = {name: [tuple(note) for note in notes] for name, notes in notified.items()}     # JSON lists
    assert all(("pager", "resolved") in notes or ("chat", "resolved") in notes for notes in notified.values()), notified
    incidents = sum(a["name"] == "RLWatchKLSpike" for a in doc["alerts"])     # the firings (2 in this run)
    assert notified["RLWatchKLSpike"].count(("pager", "firing")) == incidents, notified["RLWatchKLSpike"]
    assert notified["RLWatchKLSpike"].count(("pager", "resolved")) == incidents, notified["RLWatchKLSpike"]
    assert "resolved to pager" in result.stdout.split("Alertmanager notified: ")[1]
    assert "Prometheus fired: " in result.stdout and "Alertmanager notified: " in result.stdout
    assert "Next: " in result.stdout and "`rlwatch up`" in result.stdout
    # Every server the demo started is stopped again.
    pids = doc["demo"]["stopped_servers"]
    assert {"prometheus", "alertmanager"} <= set(pids)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.servers
def test_one_verdict_on_a_semantic_fault_with_prometheus(tmp_path):
    """A second run for the one-verdict check: the temperature fault (critical from step 0 and firing
    while it lasts, issue 15), where the real Prometheus must again fire exactly what the process fired."""
    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    result, doc = demo(tmp_path, "--scenario", "temperature_fault", "--with-prometheus")
    fired = doc["demo"]["prometheus_alerts"]
    in_process = {a["name"] for a in doc["alerts"] if a["state"] == "firing"}
    assert "RLWatchOnPolicyRatioNotOne" in in_process, result.stdout[-2000:]
    assert set(fired) == in_process, (fired, in_process)
    assert "RLWatchOnPolicyRatioNotOne" in doc["demo"]["alertmanager_alerts"]


@pytest.mark.servers
def test_the_demo_lists_an_alert_that_fired_and_resolved(tmp_path):
    """What the demo's Alertmanager sent, resolutions included, comes from its webhook receiver: an alert
    that fired and resolved before the end is listed though Alertmanager no longer has it active."""
    import urllib.request
    from datetime import datetime, timedelta, timezone

    from rlwatch.demo.app import _delivered, _prometheus_stack, _stop_stack

    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    stack = _, started, receiver = _prometheus_stack(tmp_path / "demo" / "x" / "stack")
    try:
        def post(ends: datetime | None) -> None:
            now = datetime.now(timezone.utc)
            alert = {"labels": {"alertname": "RLWatchKLSpike", "severity": "critical", "run": "demo-test"},
                     "startsAt": (now - timedelta(seconds=5)).isoformat()}
            if ends is not None:
                alert["endsAt"] = ends.isoformat()
            request = urllib.request.Request(started["alertmanager"]["url"] + "/api/v2/alerts",
                                             data=json.dumps([alert]).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=10).close()

        post(None)
        deadline = time.monotonic() + 30
        while not receiver.notifications and time.monotonic() < deadline:
            time.sleep(0.2)
        post(datetime.now(timezone.utc))                                   # resolved
        delivered = _delivered(receiver, "demo-test", quiet=5.0, timeout=30)
        active = json.loads(urllib.request.urlopen(started["alertmanager"]["url"] + "/api/v2/alerts").read())
    finally:
        _stop_stack(stack)
    assert not [a for a in active if a["labels"].get("run") == "demo-test"]     # what the demo read before
    assert delivered == {"RLWatchKLSpike": [("pager", "firing"), ("pager", "resolved")]}
