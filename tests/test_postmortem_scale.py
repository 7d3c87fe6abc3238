"""The post-mortem of a long run stays bounded (issue 37, item 13): a store of 100,000 steps (step rows
as a Watch writes them, ~440 MB) costs `rlwatch postmortem` little more memory than one of 10,000,
and the downsampled analysis still dates the change, the collapse and the alert. The 1,000,000-step
figures come from bench/bench_postmortem.py (docs/postmortem-at-scale.md)."""

from __future__ import annotations

import json
import sys

import pytest

from bench.bench_postmortem import RUN, build_store, measure

#: Peak RSS the 100,000-step post-mortem may use above the 10,000-step one (reading the whole run, as
#: before, costs ~4 GB more).
RSS_GROWTH_MIB = 150


@pytest.mark.slow
def test_a_ten_times_longer_run_costs_bounded_memory_and_is_still_dated(tmp_path):
    runs = {}
    for steps in (10_000, 100_000):
        store = build_store(tmp_path / f"run-{steps}.db", steps)
        wall, rss, rc, output = measure([sys.executable, "-m", "rlwatch", "postmortem", str(store), "--json"])
        assert rc == 0, output[-2000:]
        runs[steps] = (wall, rss, json.loads(output[output.index("{"):]))
        store.unlink()
    (small_wall, small_rss, _), (wall, rss, doc) = runs[10_000], runs[100_000]
    assert rss <= small_rss + RSS_GROWTH_MIB, (f"peak RSS {rss:.0f} MiB at 100k steps against {small_rss:.0f} MiB "
                                               f"at 10k ({wall:.1f} s against {small_wall:.1f} s)")
    assert doc["run"] == RUN and doc["steps"] == [0, 99_995]            # buckets of 5 steps
    assert doc["collapse_step"] == 70_000
    first = {c["signal"]: c["step"] for c in doc["first_signals"]}
    assert first["mismatch_kl_k3"] == 60_000 and first["reward_mean"] == 70_000
    assert [(a["name"], a["step"]) for a in doc["alerts"]] == [("RLWatchKLSpike", 60_020)]
    assert doc["resume"]["checkpoint"]["step"] == 59_999
    assert any(e["kind"] == "downsampled" and "buckets of 5 steps" in e["detail"] for e in doc["events"])


def test_a_long_runs_signals_hold_everything_the_diagnosis_reads(tmp_path):
    """A bucketed run keeps only :func:`read_signals`: the diagnosis on those alone is the diagnosis on
    every signal (so ``rlwatch.analyses.diagnosis.INPUTS`` lists all it reads)."""
    import rlwatch
    from rlwatch.analyses.diagnosis import diagnose
    from rlwatch.postmortem import load, read_signals

    from tests.conftest import make_step

    path = str(tmp_path / "run.db")
    with rlwatch.Watch(run="r", port=None, store=path) as watch:
        for step in range(30):
            watch.observe(step, **make_step(B=8, T=16, seed=step, lag_max=3, noise=0.3 if step >= 15 else 0.05))
    steps = [values for _, values in load(path).steps]
    kept = set(read_signals())
    assert diagnose(steps).as_dict() == diagnose([{k: v for k, v in s.items() if k in kept} for s in steps]).as_dict()
    assert diagnose(steps).cause != "none"
