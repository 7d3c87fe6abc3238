"""What the post-mortem tells beyond the dates: a behaviour correction that held a lag fault (lag
and KL alerts, a correction on, no collapse: the demo's "rescued" scenario) is said so; the
reward-hack section shows episodes from the hack's rise, not from step 0; and the report prints
no library chatter (matplotlib's "generated new fontManager" on a fresh font cache)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import rlwatch
from rlwatch.postmortem.analysis import analyse, correction_in_use, summarize_hacks
from rlwatch.postmortem.changes import Change
from rlwatch.postmortem.report import text_report
from rlwatch.postmortem.sources import RunData

from tests.conftest import ROOT

ALERTS = [{"name": "RLWatchVersionLagFarAboveBound", "severity": "critical", "step": 5, "state": "firing"},
          {"name": "RLWatchKLSpike", "severity": "critical", "step": 18, "state": "firing"}]


def rescued(meta: dict, quality: list[float]) -> RunData:
    return RunData(run="r", source="s", meta=meta, alerts=[dict(a) for a in ALERTS],
                   scalars={"heldout_true_reward": list(enumerate(quality))})


def test_a_correction_that_held_a_lag_fault_is_said_so():
    kept = [0.2 + 0.01 * t for t in range(40)] + [0.6] * 60
    report = analyse(rescued({"correction": "tis"}, kept))
    assert report.collapse_step is None
    held = report.correction_held
    assert held and held.startswith("the correction (TIS) held a lag fault: RLWatchVersionLagFarAboveBound fired at "
                                    "step 5 and RLWatchKLSpike at step 18"), held
    assert f"held: {held}" in text_report(report) and report.as_json()["correction_held"] == held


def test_no_such_claim_without_a_correction_or_with_a_collapse():
    kept = [0.5] * 100
    assert analyse(rescued({"correction": "none"}, kept)).correction_held is None
    assert analyse(rescued({}, kept)).correction_held is None
    collapsed = [0.5] * 30 + [0.0] * 70
    assert analyse(rescued({"correction": "tis"}, collapsed)).correction_held is None


def test_the_correction_is_read_from_trl_and_openrlhf_metadata():
    assert correction_in_use({"trl": {"vllm_importance_sampling_correction": True,
                                      "vllm_importance_sampling_mode": "token_truncate"}}) \
        == "TRL's importance sampling (token_truncate)"
    assert correction_in_use({"openrlhf": {"is_correction": True}}) == "OpenRLHF's importance-sampling correction"
    assert correction_in_use({"trl": {"vllm_importance_sampling_correction": False}}) is None


def test_hack_examples_come_from_the_rise():
    labels = ("reverse", "prefix")
    steps = [(s, {"env_hack_ratio": {labels: 0.02 if s < 7 else 0.6}}) for s in range(30)]
    examples = [{"env": "reverse", "detector": "prefix", "step": s, "reason": "prefix", "response": [1],
                 "reward": 1.0} for s in range(30)]
    data = RunData(run="r", source="s", steps=steps, hack_examples=examples)
    change = Change("env_hack_ratio", labels, 7, 9, 0.02, 0.6, 0.01)
    (hack,) = summarize_hacks(data, [change])
    assert hack["step"] == 7 and [e["step"] for e in hack["examples"]] == [7, 8, 9]
    (undated,) = summarize_hacks(data, [])
    assert [e["step"] for e in undated["examples"]] == [27, 28, 29]       # undated: the latest ones


@pytest.mark.slow
def test_the_report_prints_no_matplotlib_chatter(tmp_path):
    pytest.importorskip("matplotlib")
    store = tmp_path / "run.db"
    with rlwatch.Watch(run="quiet", port=None, store=str(store), alerts=False) as watch:
        for step in range(20):
            watch.log_scalars(step, {"heldout_true_reward": 0.5 if step < 10 else 0.0})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MPLCONFIGDIR=str(tmp_path / "fresh-matplotlib-cache"))      # the font cache is built anew
    result = subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", str(store), "--out",
                             str(tmp_path / "report")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "report" / "quality.png").exists()
    assert "fontManager" not in result.stdout + result.stderr, result.stderr[-2000:]
    assert not [line for line in result.stderr.splitlines() if line.strip()], result.stderr[-2000:]
