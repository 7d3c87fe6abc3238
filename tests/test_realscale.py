"""The real-scale family (evaluation.realscale): a sample of its test split at the shipped defaults
meets the paging bars, and the k3 forecast is right on log-linear growth and absent without a trend."""

from __future__ import annotations

import math
import random

from rlwatch.alerts.history import History
from rlwatch.alerts.params import thresholds
from rlwatch.alerts.template import render
from rlwatch.alerts.trend import forecast_steps
from evaluation.realscale import CI_SAMPLE, TEST, collect, RealRun
from evaluation.realscale_eval import first_warning_fraction, lead_fraction, replay


def _history(k3: list[float]) -> History:
    return History([(t, {"mismatch_kl_k3": {(): v}}) for t, v in enumerate(k3)], thresholds())


def test_the_forecast_is_within_30_percent_on_log_linear_growth():
    rng = random.Random(1)
    for base, rate in ((1e-3, 0.02), (4e-3, 0.01), (5e-4, 0.03)):
        k3 = [base * math.exp(rate * t) * rng.lognormvariate(0, 0.08) for t in range(60)]
        truth = math.log(0.1 / (base * math.exp(rate * 59))) / rate
        steps = forecast_steps(_history(k3), 0.1)
        assert steps is not None and abs(steps - truth) <= 0.3 * truth, (base, rate, steps, truth)


def test_no_forecast_without_a_trend():
    rng = random.Random(2)
    flat = [1e-3 * rng.lognormvariate(0, 0.3) for _ in range(60)]
    falling = [1e-2 * math.exp(-0.01 * t) * rng.lognormvariate(0, 0.1) for t in range(60)]
    assert forecast_steps(_history(flat), 0.1) is None
    assert forecast_steps(_history(falling), 0.1) is None


def test_the_description_carries_the_forecast_only_when_known():
    from rlwatch.alerts.domains.mismatch import KL_DEPARTURE

    known = render(KL_DEPARTURE.description, {"run": "r"}, 0.012, {"baseline_ratio": 12.0, "forecast_steps": 60.4})
    assert "k3 0.012 nats, 12x its baseline; at this rate kl_k3_max in ~60 steps;" in known
    bare = render(KL_DEPARTURE.description, {"run": "r"}, 0.012, {})
    assert "baseline;" not in bare and "at this rate" not in bare and "{{" not in bare


def test_a_real_scale_sample_meets_the_paging_bars_at_the_shipped_defaults():
    """A healthy run with isolated spikes: no page, no mismatch warning; a fast collapse and a weight-sync
    step: paged in the first half of the departure-to-collapse time (the shipped defaults)."""
    shapes = {s.name: s for s in TEST}
    for name in CI_SAMPLE:
        trace = collect(RealRun(shapes[name], 10))
        outcome = replay(trace, {})
        if outcome.kind == "healthy":
            assert outcome.firings("critical") == []
            assert [e for e in outcome.firings() if e.name in ("RLWatchMismatchDrift", "RLWatchKLJump")] == []
        else:
            assert (lead_fraction(outcome, trace["depart_step"]) or 0) >= 0.5, outcome.events
            assert first_warning_fraction(outcome, trace["depart_step"]) is not None


def test_prometheus_decides_as_the_process_on_a_real_scale_run_at_10s_steps():
    """promtool replays a weight-sync collapse's exported window values with a step every 10 s (5 s
    scrapes) and fires exactly the alerts the embedded evaluator fires, at every step."""
    from evaluation.acceptance import prometheus_agrees

    from tests.conftest import need_binary

    need_binary("promtool")
    trace = collect(RealRun({s.name: s for s in TEST}["fp8_syncbug"], 11))
    agreement = prometheus_agrees([trace], {}, step_seconds=10, scrape=5)
    assert agreement["ok"], agreement["promtool_tail"]
    assert agreement["steps"] == len(trace["steps"])


def test_the_console_firing_line_carries_the_forecast(caplog):
    """The evaluator's FIRING line for a k3 climbing log-linearly from a flat 1e-3 says how far k3 is
    above its baseline and how many steps remain to kl_k3_max."""
    from rlwatch.alerts.evaluator import AlertEvaluator

    rng = random.Random(3)
    k3 = [1e-3 * rng.lognormvariate(0, 0.05) for _ in range(40)]
    k3 += [1e-3 * math.exp(0.05 * t) * rng.lognormvariate(0, 0.05) for t in range(1, 60)]
    evaluator = AlertEvaluator("r1", watchdog_interval=0)
    with caplog.at_level("WARNING", logger="rlwatch"):
        for step, value in enumerate(k3):
            evaluator.on_step(step, {"mismatch_kl_k3": {(): value}, "step": {(): float(step)}})
    evaluator.close()
    lines = [r.getMessage() for r in caplog.records if "FIRING RLWatchKLDeparture" in r.getMessage()]
    assert len(lines) == 1 and "x its baseline; at this rate kl_k3_max in ~" in lines[0], lines
