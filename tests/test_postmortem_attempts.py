"""A resumed run in the post-mortem: alerts and checkpoints carry the attempt that wrote them; the
report shows the final attempt's timeline and lists what a superseded attempt raised or saved as
such (issue 25, item 7), also for stores written before alerts and checkpoints had an attempt."""

from __future__ import annotations

import sqlite3

import rlwatch
from rlwatch.postmortem import analyse, load, run_postmortem
from rlwatch.postmortem.report import markdown, text_report
from rlwatch.runs.store import RunStore, StoreReader

from tests.conftest import make_step


def resumed_run(path: str) -> None:
    """Attempt 1 spikes at steps 40-47 (k3 ~0.4, KLSpike opens at 41) and dies; attempt 2 resumes at
    step 30 from checkpoint 29 and stays healthy to step 59."""
    with rlwatch.Watch(run="resumed", port=None, store=path) as first:
        for step in range(48):
            first.observe(step, **make_step(B=8, T=16, seed=step, lag_max=0, noise=0.8 if step >= 40 else 0.02))
            if step in (29, 45):
                first.record_checkpoint(step, f"/ckpt/checkpoint-{step}")
    with rlwatch.Watch(run="resumed", port=None, store=path) as second:
        for step in range(30, 60):
            second.observe(step, **make_step(B=8, T=16, seed=1000 + step, lag_max=0, noise=0.02))
            if step == 49:
                second.record_checkpoint(step, f"/ckpt/checkpoint-{step}")


def check_report(path: str, first: str, second: str) -> None:
    doc = run_postmortem(path, quiet=True)
    assert ("RLWatchKLSpike", 41) not in {(a["name"], a["step"]) for a in doc["alerts"]}, doc["alerts"]
    spike = [a for a in doc["superseded"]["alerts"] if a["name"] == "RLWatchKLSpike"]
    assert [(a["step"], a["attempt"], a["superseded_by"], a["resumed_at"]) for a in spike] == [(41, first, second, 30)]
    assert [(c["step"], c["attempt"]) for c in doc["superseded"]["checkpoints"]] == [(45, first)]
    data = load(path)
    assert data.checkpoints == [(29, "/ckpt/checkpoint-29"), (49, "/ckpt/checkpoint-49")]
    k3 = dict(data.series("mismatch_kl_k3"))
    assert sorted(k3) == list(range(60)) and max(k3.values()) < 0.01       # attempt 2's values from step 30
    report = analyse(data)
    text = text_report(report)
    timeline, superseded = text.split("superseded attempts")
    assert "RLWatchKLSpike" not in timeline.split("alerts")[-1]
    assert "41  critical RLWatchKLSpike" in superseded and f"replaced from step 30 by attempt {second}" in superseded
    assert "checkpoint /ckpt/checkpoint-45" in superseded


def test_a_resumed_run_shows_the_final_attempt_and_lists_the_dead_attempts_alerts(tmp_path):
    path = str(tmp_path / "run.db")
    resumed_run(path)
    with StoreReader(path) as store:
        first, second = (a["id"] for a in store.attempts("resumed"))
        written = {(a["name"], a["step"], a["state"]): a["attempt"] for a in store.alerts("resumed")}
    assert written[("RLWatchKLSpike", 41, "firing")] == first
    check_report(path, first, second)
    markdown(analyse(load(path)), [], tmp_path)
    md = (tmp_path / "postmortem.md").read_text()
    assert "## Superseded attempts" in md and "- step    41  critical RLWatchKLSpike" in md


def test_a_store_from_before_attempts_on_alerts_is_migrated_and_read(tmp_path):
    """Old rows carry no attempt: each is given the attempt running at its time. A writer opening
    the old store adds the columns and writes new rows with their attempt."""
    path = str(tmp_path / "run.db")
    resumed_run(path)
    conn = sqlite3.connect(path)
    first, second = (r[0] for r in conn.execute("SELECT id FROM attempts ORDER BY started"))
    for table in ("alerts", "checkpoints"):               # the tables as an older version created them
        columns = [r[1] for r in conn.execute(f"PRAGMA table_info({table})") if r[1] != "attempt"]
        conn.execute(f"ALTER TABLE {table} DROP COLUMN attempt")
        assert [r[1] for r in conn.execute(f"PRAGMA table_info({table})")] == columns
    conn.commit()
    conn.close()
    check_report(path, first, second)
    store = RunStore(path)
    store.submit_alert("resumed", 60, "RLWatchX", "warning", "firing", {}, 1.0, {})
    store.submit_checkpoint("resumed", 60, "/ckpt/checkpoint-60")
    store.close()
    with StoreReader(path) as reader:
        assert reader.alerts("resumed")[-1]["attempt"] == store.attempt
        assert reader.checkpoints("resumed")[-1] == (60, "/ckpt/checkpoint-60")
    doc = run_postmortem(path, quiet=True)
    assert doc["alerts"][-1]["name"] == "RLWatchX" and "RLWatchKLSpike" not in {a["name"] for a in doc["alerts"]}
    assert [a["step"] for a in doc["superseded"]["alerts"] if a["name"] == "RLWatchKLSpike"] == [41]
