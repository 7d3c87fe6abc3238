"""Two processes writing one run at the same time (one run name, the default store in one directory) are
concurrent writers, not a resume (issue 37, item 14): the post-mortem says so and lists both processes'
alerts in the timeline; before, the first process's critical alert was only "superseded" and the report
read "alerts: none fired"."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rlwatch.postmortem import analyse, load, run_postmortem
from rlwatch.postmortem.report import text_report
from rlwatch.runs.store import StoreReader

ROOT = Path(__file__).resolve().parent.parent

#: One trainer: opens a Watch on run "shared" (default store), says so in argv[2], waits for argv[3]
#: (the other trainer's), then observes steps 0-59; the mismatch jumps on steps argv[1] (FROM:TO).
TRAINER = """
import os, sys, time
import rlwatch
from tests.conftest import make_step
spike = range(*map(int, sys.argv[1].split(":")))
with rlwatch.Watch(run="shared", port=None) as watch:
    open(sys.argv[2], "w").close()
    deadline = time.time() + 60
    while not os.path.exists(sys.argv[3]) and time.time() < deadline:
        time.sleep(0.05)
    for step in range(60):
        watch.observe(step, **make_step(B=8, T=16, seed=step + spike.start, lag_max=0,
                                        noise=0.8 if step in spike else 0.02))
        time.sleep(0.02)
"""


def test_two_processes_writing_one_run_at_once_are_concurrent_writers_with_both_alerts(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), RLWATCH_DIR=str(tmp_path / "runs"))
    ready = [str(tmp_path / "first.ready"), str(tmp_path / "second.ready")]
    first = subprocess.Popen([sys.executable, "-c", TRAINER, "40:60", ready[0], ready[1]], cwd=ROOT, env=env)
    try:
        deadline = time.time() + 60
        while not os.path.exists(ready[0]) and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        second = subprocess.Popen([sys.executable, "-c", TRAINER, "15:25", ready[1], ready[0]], cwd=ROOT, env=env)
        try:
            assert second.wait(timeout=120) == 0 and first.wait(timeout=120) == 0
        finally:
            second.kill()
    finally:
        first.kill()
    path = str(tmp_path / "runs" / "shared.db")
    with StoreReader(path) as store:
        early, late = (a["id"] for a in store.attempts("shared"))       # oldest first
        raised = {(a["name"], a["step"], a["attempt"]) for a in store.alerts("shared") if a["state"] == "firing"}
    spikes = {("RLWatchKLSpike", 41, early), ("RLWatchKLSpike", 16, late)}      # each process's critical alert
    assert spikes <= raised, raised

    doc = run_postmortem(path, quiet=True)
    assert [[w["id"] for w in group] for group in doc["concurrent_writers"]] == [[early, late]]
    assert spikes <= {(a["name"], a["step"], a["attempt"]) for a in doc["alerts"]}, doc["alerts"]
    assert "superseded" not in doc
    text = text_report(analyse(load(path)))
    assert "concurrent writers: 2 processes wrote this run at the same time" in text and "not a resume" in text
    assert "alerts: none fired" not in text and "superseded attempts" not in text
    alerts = text.split("\nalerts:\n")[1].splitlines()
    for step, attempt in ((41, early), (16, late)):
        assert any(f"step {step:>5}  critical RLWatchKLSpike" in line and line.endswith(f"(attempt {attempt})")
                   for line in alerts), text
