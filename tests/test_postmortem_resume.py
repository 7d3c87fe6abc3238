"""Where the post-mortem says to resume when it finds no cause: before the first concerning change
since the quality's peak, not before a change the run went on improving after (a real run's entropy
falls in its first steps), on a hand-made run and on a public log of a real collapse."""

from __future__ import annotations

import random
from pathlib import Path

from rlwatch.postmortem import analyse
from rlwatch.postmortem.sources import RunData
from rlwatch.replay import load, replay

ROOT = Path(__file__).resolve().parents[1]
MIXED_CUTS = ROOT / "evaluation" / "realruns" / "data" / "grpo-h200-mixed-cuts" / "metrics.jsonl"


def _run(checkpoints: bool = True) -> RunData:
    """Entropy falls over steps 0-6 while the reward climbs to its plateau (from step 20); the truncated
    ratio rises from step 34; the reward collapses at 45."""
    rng = random.Random(0)
    steps = []
    for step in range(60):
        entropy = 0.6 - 0.06 * min(step, 6) + rng.gauss(0, 0.005)
        truncated = (0.02 if step < 34 else 0.5) + rng.gauss(0, 0.005)
        reward = (0.2 + 0.03 * min(step, 20) if step < 45 else 0.05) + rng.gauss(0, 0.01)
        steps.append((step, {"entropy_mean": {(): entropy}, "truncated_ratio": {(): truncated},
                             "reward_mean": {(): reward}}))
    return RunData(run="r", source="s", steps=steps,
                   checkpoints=[(s, f"/c/checkpoint-{s}") for s in range(0, 60, 5)] if checkpoints else [])


def test_without_a_cause_the_resume_point_is_before_the_first_change_since_the_peak():
    report = analyse(_run())
    assert report.collapse_step == 45 and report.diagnosis.cause == "none"
    changed = {c.signal: c.step for c in report.first_signals}
    assert changed["entropy_mean"] <= 6 < report.peak[0] <= changed["truncated_ratio"] <= 34
    resume = report.resume
    assert resume.trouble_step == changed["truncated_ratio"]
    assert resume.checkpoint == (30, "/c/checkpoint-30")          # not checkpoint-0, before the entropy's fall
    assert f"the first change since the peak of reward_mean at step {report.peak[0]}: truncated_ratio" \
        in resume.reason


def test_without_a_change_since_the_peak_the_collapse_is_the_trouble():
    data = _run()
    for _, values in data.steps:
        values.pop("truncated_ratio")
    resume = analyse(data).resume
    assert resume.trouble_step == 45 and resume.checkpoint == (40, "/c/checkpoint-40")
    assert "the collapse at step 45; no signal changed since the peak of reward_mean" in resume.reason


def test_a_real_collapse_without_checkpoints_names_the_change_that_led_into_it(tmp_path):
    """The Mixed-CUTS run (docs/real-runs.md): its entropy falls from step 4 while the score climbs to its
    peak at 14; its clipped ratio leaves its level at 42, fourteen steps before the collapse at 56."""
    result = replay(load(MIXED_CUTS), store_dir=tmp_path)
    resume = result.postmortem["resume"]
    assert result.postmortem["collapse_step"] == 56
    assert resume["checkpoint"] is None and resume["trouble_step"] == 42, resume
    assert "the trouble began at step 42" in resume["reason"] and "truncated_ratio from step 42" in resume["reason"]


def test_an_entropy_surge_is_a_change_in_a_trouble_direction():
    """Entropy rising towards random text precedes collapses as its fall does (RLWatchEntropySurge beside
    RLWatchEntropyCollapse): a rise after the peak is where the trouble began."""
    data = _run()
    for step, values in data.steps:
        values.pop("truncated_ratio")
        values["entropy_mean"] = {(): (0.24 if step < 37 else 1.5) + 0.005 * (step % 3)}
    report = analyse(data)
    [rise] = [c for c in report.first_signals if c.signal == "entropy_mean"]
    assert rise.direction == "up" and rise.concerning and rise.step == 37
    assert report.resume.trouble_step == 37 and report.resume.checkpoint == (35, "/c/checkpoint-35")
