"""Reward-hack verdicts count for the step their episodes came from, however late a slowed detector
delivers them; the post-mortem names a hack present from the first steps; the hack demo pages and its
post-mortem names the hack with examples while another process loads the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlwatch
from rlwatch import hacks
from rlwatch.postmortem.analysis import analyse
from rlwatch.postmortem.sources import RunData, from_store

HACKED_FROM = 6
STEPS = 14


def _slow_verdict(ep: hacks.Episode) -> bool:
    """A detector slower than the steps (as a loaded machine makes any detector): 20 ms an episode."""
    time.sleep(0.02)
    return ep.response == "exploit"


def test_a_slow_detectors_verdicts_are_stored_under_their_own_steps(tmp_path):
    detector = hacks.Detector("slow_check", _slow_verdict)
    path = str(tmp_path / "run.db")
    with rlwatch.Watch(run="slow", port=None, store=path, hack_detectors=[detector], strict=True) as watch:
        for step in range(STEPS):
            answer = "exploit" if step >= HACKED_FROM else "honest"
            episodes = [{"prompt": "p", "response": answer if i < 6 else "honest", "reward": 1.0, "env": "task"}
                        for i in range(8)]
            watch.observe(step, mask=[[1]] * 8, rewards=[1.0] * 8, episodes=episodes)   # no wait: they lag
        lagging = watch.hacks._submitted - watch.hacks._done
    assert lagging > 2, "the detector kept up with the steps: the test shows nothing"
    series = dict(from_store(path).series("env_hack_ratio", ("task", "slow_check")))
    # Every step's own rate, under its own step, the last one included (its verdicts came after it).
    assert series == {step: (0.75 if step >= HACKED_FROM else 0.0) for step in range(STEPS)}, series


def _run_data(rates: list[float], alerts: list[dict] | None = None) -> RunData:
    steps = [(s, {"env_hack_ratio": {("reverse", "verifier"): r}, "reward_mean": {(): 0.5}})
             for s, r in enumerate(rates)]
    examples = [{"step": 3, "env": "reverse", "detector": "verifier", "reason": "checker fails",
                 "prompt": "1 2", "response": "", "reward": 1.0}]
    return RunData(run="r", source="test", steps=steps, hack_examples=examples, alerts=alerts or [])


def test_a_hack_present_from_the_first_steps_is_named_with_its_examples():
    report = analyse(_run_data([0.8, 0.9, 0.85, 0.9] * 10))
    assert report.cause == "reward_hacking", report.cause
    (hack,) = report.hacks
    assert hack["env"] == "reverse" and hack["examples"] and hack["late_rate"] > 0.8
    assert any("high from the first steps" in line for line in report.evidence), report.evidence


def test_a_low_flat_hack_rate_is_not_named_unless_its_alert_fired():
    assert analyse(_run_data([0.02, 0.03] * 20)).cause != "reward_hacking"
    paged = [{"name": "RLWatchRewardHackRateRising", "severity": "critical", "state": "firing", "step": 30,
              "labels": {"env": "reverse", "detector": "verifier"}}]
    assert analyse(_run_data([0.02, 0.03] * 20, paged)).cause == "reward_hacking"


def _loader() -> subprocess.Popen:
    """Another process keeping a CPU busy (the machine's load), stopped by its PID."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


@pytest.mark.slow
def test_the_hack_demo_pages_and_names_the_hack_on_a_loaded_machine(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    loaders = [_loader() for _ in range(2)]
    try:
        demo = subprocess.run([sys.executable, "-m", "rlwatch", "demo", "--scenario", "hack", "--no-live",
                               "--port", "0", "--out", "demo"], capture_output=True, text=True, timeout=400,
                              cwd=tmp_path, env=env)
    finally:
        for p in loaders:
            p.kill()
            p.wait()
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    (store,) = (tmp_path / "demo").glob("hack-*/run.db")
    post = subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", str(store), "--json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert post.returncode == 0, post.stderr[-3000:]
    doc = json.loads(post.stdout)
    assert any(a["name"] == "RLWatchRewardHackRateRising" and a["severity"] == "critical"
               and a["labels"].get("env") == "reverse" for a in doc["alerts"]), doc["alerts"]
    assert doc["cause"] == "reward_hacking", doc["cause"]
    (hack,) = [h for h in doc["hacks"] if h["env"] == "reverse"]
    assert hack["examples"], hack
