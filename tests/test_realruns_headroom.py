"""evaluation.realruns.headroom: how early any threshold on the logged signals could page a collapse
without paging a healthy run (one statistic, or two of different signals)."""

from __future__ import annotations

import statistics

from evaluation.realruns import corpus
from evaluation.realruns.headroom import Envelope, headroom, measure, run_points


def _entry(run_id: str, outcome: str, collapse_step: int | None) -> corpus.CorpusRun:
    return corpus.CorpusRun(id=run_id, files=(), format="csv", split="test", source="s", outcome=outcome,
                            collapse_step=collapse_step)


def _points(values: dict[str, list[float]]) -> list[tuple[int, dict[str, float]]]:
    steps = len(next(iter(values.values())))
    return [(t, {k: v[t] for k, v in values.items()}) for t in range(steps)]


def test_one_statistic_beyond_every_healthy_row_and_a_pair_beyond_the_front():
    healthy = {"h1": _points({"a rise up": [1.0, 2.0, 1.5], "b rise up": [1.0, 1.0, 3.0]}),
               "h2": _points({"a rise up": [1.2, 1.1, 1.0], "b rise up": [1.0, 1.1, 1.2]})}
    envelope = Envelope(healthy, min_healthy=2)
    assert envelope.beyond({"a rise up": 2.1}, "a rise up")
    assert not envelope.beyond({"a rise up": 2.0}, "a rise up")        # a healthy row as far out
    # (1.8, 1.5): healthy rows (2.0, 1.0) and (1.5, 3.0) each pass it on one statistic only.
    assert envelope.beyond({"a rise up": 1.8, "b rise up": 1.5}, "a rise up", "b rise up")
    assert not envelope.beyond({"a rise up": 1.4, "b rise up": 2.5}, "a rise up", "b rise up")
    assert not Envelope(healthy, min_healthy=3).judged("a rise up")


def test_the_earliest_row_before_the_collapse_beyond_the_healthy_runs():
    healthy = {"h1": _points({"entropy_mean rise up": [1.0, 1.3, 1.6, 1.4], "grad_norm rise up": [1.0] * 4}),
               "h2": _points({"entropy_mean rise up": [1.0, 1.1, 1.2, 1.1], "grad_norm rise up": [1.0, 3.0, 1, 1]})}
    envelope = Envelope(healthy, min_healthy=2)
    collapsed = _points({"entropy_mean rise up": [1.0, 1.2, 1.5, 1.7, 2.5, 4.0],
                         "grad_norm rise up": [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]})
    found = headroom(_entry("c", "collapsed", 5), collapsed, envelope)
    assert found.one == (3, "entropy_mean rise up") and found.lead(found.one) == 2
    assert found.two == (2, "entropy_mean rise up", "grad_norm rise up")    # (1.5, 2.0): no healthy row past both
    late = headroom(_entry("c", "collapsed", 3), collapsed, envelope)
    assert late.one is None                                                  # beyond only from the collapse on


def test_a_run_s_statistics_are_its_logged_values_medians():
    entry = next(e for e in corpus.runs("all") if e.id == "verl-commeff-exp27-damped-ef")
    run = corpus.load_run(entry)
    key = next(k for k, s in run.recognised().items() if s == "grad_norm")
    series = [v for _, v in run.series(key)]
    step, point = run_points(entry)[20]
    assert step == run.steps[20] and len(series) > 20
    level = statistics.median(series[16:21])
    assert point["grad_norm level up"] == level and point["grad_norm level down"] == -level
    assert point["grad_norm rise up"] == level / statistics.median(series[:10])


def test_rows_without_a_learning_signal_give_no_batch_statistic():
    entry = next(e for e in corpus.runs("all") if e.id == "trl-illustrated-6digit-lora")
    run = corpus.load_run(entry)
    zero_std = next(k for k, s in run.recognised().items() if s == "zero_std_ratio")
    points = dict(run_points(entry))
    dead = [s for s, row in zip(run.steps, run.rows) if row.get(zero_std) == 1.0]
    live = [s for s, row in zip(run.steps, run.rows) if row.get(zero_std) == 0.0]
    assert dead and live
    assert all(not any(k.startswith(("entropy_mean ", "grad_norm ")) for k in points[s]) for s in dead)
    assert any(k.startswith("entropy_mean ") for k in points[live[-1]])
    assert any(k.startswith("reward_mean ") for k in points[dead[-1]])      # the reward is judged on every row


def test_thresholds_set_on_the_tuning_split_judge_the_test_runs_only():
    found = measure("tuning")
    assert found and {h.split for h in found} == {"test"}
    assert {h.outcome for h in found} == {"collapsed", "healthy"}
    assert all(h.one is None or h.collapse_step is None or h.one[0] < h.collapse_step for h in found)
