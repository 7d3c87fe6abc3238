"""The post-mortem dates a collapse at the first sustained drop of the run's quality, whatever
happens after it (rlwatch/postmortem/analysis.py, find_collapse): on the demo's own stored held-out
reward (tests/data/demo_collapse_heldout.json, written by `rlwatch demo --no-live`), which falls
from its peak 0.53 (step 11) to 0.16 at step 18 and to 0 from step 32, then climbs back partly to
0.33 at step 88; and on synthetic curves with noise, partial and full recoveries, late collapses,
brief dips and no collapse at all. The rule's constants were chosen on bench/collapse_tuning.py's
tuning curves; the curves here are not among them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rlwatch.postmortem.analysis import COLLAPSE_HOLD, analyse, find_collapse
from rlwatch.postmortem.report import headline
from rlwatch.postmortem.sources import RunData

DEMO = json.loads((Path(__file__).parent / "data" / "demo_collapse_heldout.json").read_text())["series"]


def first_sustained_drop(series, fraction: float = 0.5, window: int = 10) -> int:
    """An independent reading of a curve: the first step after which the median of the next
    ``window`` values is below ``fraction`` of the peak reached so far."""
    best = float("-inf")
    for i, (step, value) in enumerate(series):
        best = max(best, value)
        ahead = sorted(v for _, v in series[i:i + window])
        if value < fraction * best and ahead[len(ahead) // 2] < fraction * best:
            return step
    raise AssertionError("no sustained drop")


def test_the_demo_curve_is_dated_at_its_first_sustained_drop_not_its_tail():
    found = find_collapse([tuple(p) for p in DEMO])
    assert found is not None
    assert abs(found.step - first_sustained_drop(DEMO)) <= 3, found.step
    assert found.step < 32                                 # before the reward reached 0
    assert found.peak == (11, pytest.approx(0.53125))
    assert found.recovery == (88, pytest.approx(0.328125)) and not found.recovered_fully
    assert found.recovery_text() == "recovered to 0.33 at step 88, below its peak of 0.53; 0.08 at step 99"


def test_the_report_resume_and_fallback_follow_the_new_date():
    data = RunData(run="r", source="s", scalars={"heldout_true_reward": [tuple(p) for p in DEMO]},
                   checkpoints=[(s, f"/c/checkpoint-{s}") for s in range(4, 100, 5)])
    report = analyse(data)
    assert report.collapse_step == 18
    assert report.resume.checkpoint == (14, "/c/checkpoint-14")     # the last one before step 18, not 89
    assert "collapsed at step 18 (recovered to 0.33 at step 88, below its peak of 0.53" in headline(report)
    assert report.as_json()["recovery"]["step"] == 88


def plateau(n: int, level: float, noise: float, rng: random.Random) -> list[float]:
    return [max(0.0, level + rng.gauss(0, noise)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_noisy_curves_without_a_collapse_have_none(seed):
    rng = random.Random(100 + seed)
    values = [0.1 + 0.05 * t for t in range(8)] + plateau(92, 0.5, 0.06, rng)
    assert find_collapse(list(enumerate(values))) is None


def test_a_brief_dip_is_not_a_collapse():
    rng = random.Random(7)
    values = plateau(40, 0.6, 0.03, rng) + [0.05, 0.1, 0.08] + plateau(40, 0.6, 0.03, rng)
    assert find_collapse(list(enumerate(values))) is None


@pytest.mark.parametrize("seed", range(5))
def test_a_noisy_collapse_with_a_partial_recovery_is_dated_at_the_drop(seed):
    rng = random.Random(200 + seed)
    values = plateau(30, 0.6, 0.04, rng) + plateau(40, 0.03, 0.01, rng) + plateau(30, 0.35, 0.03, rng)
    found = find_collapse(list(enumerate(values)))
    assert found is not None and found.step == 30
    assert found.recovery is not None and 70 <= found.recovery[0] and not found.recovered_fully


def test_a_full_recovery_is_reported_as_such_and_keeps_the_date():
    values = [0.5] * 20 + [0.05] * 15 + [0.55] * 10
    found = find_collapse(list(enumerate(values)))
    assert found.step == 20 and found.recovered_fully and "back to its peak" in found.recovery_text()


def test_a_late_collapse_that_lasts_to_the_end_is_dated():
    values = [0.5] * 95 + [0.1] * 5
    assert find_collapse(list(enumerate(values))).step == 95
    assert find_collapse(list(enumerate([0.5] * 99 + [0.1]))) is None     # one last point is not a drop


def test_a_slow_decline_is_dated_where_it_crosses_the_rule():
    values = [0.6] * 20 + [0.6 - 0.03 * t for t in range(1, 21)] + [0.0] * 20
    found = find_collapse(list(enumerate(values)))
    assert found is not None and 30 <= found.step <= 36                 # 0.4 x 0.6 = 0.24 at step 32


def test_sparse_evaluations_count_evaluations_not_steps():
    values = [(s, 0.5) for s in range(0, 200, 10)] + [(s, 0.05) for s in range(200, 200 + 10 * COLLAPSE_HOLD, 10)]
    assert find_collapse(values).step == 200
