"""Every alert line says what its value is, with its unit (console, trainer log, chat, landing page),
and no line forecasts the time to a bound k3 has already passed."""

from __future__ import annotations

import logging
import math
import random
import re

from rlwatch.alerts.catalogue import ALERTS
from rlwatch.alerts.domains.dynamics import POLICY_KL
from rlwatch.alerts.domains.mismatch import KL_SPIKE
from rlwatch.alerts.evaluator import AlertEvaluator
from rlwatch.alerts.history import History
from rlwatch.alerts.notify import AlertEvent, SlackNotifier, log_event, quiet_alert_log
from rlwatch.alerts.params import thresholds
from rlwatch.alerts.template import render
from rlwatch.alerts.trend import forecast_steps


def _event(name: str, value: float) -> AlertEvent:
    alert = next(a for a in ALERTS if a.name == name)
    return AlertEvent(alert.name, alert.severity, "firing", "r1", 22, {"signal": "mismatch_kl_k3"}, value,
                      alert.summary, "d", "http://x/runbook", value_format=alert.value_format)


def test_every_alert_names_its_value_and_its_unit():
    for alert in ALERTS:
        text = alert.value_format.format(0.25)
        assert not text.startswith("value") and re.search("[a-z][a-z0-9]+", text), (alert.name, text)   # named
        assert alert.value_format.count("{") == 1, alert.name
    assert _event("RLWatchMismatchDrift", 40.0).value_text == "drift score 40 robust standard deviations (CUSUM)"
    assert _event("RLWatchKLSpike", 0.2304).value_text == "k3 0.2304 nats"
    assert _event("RLWatchStalenessBoundExceeded", 0.4961).value_text == "49.6% of tokens over the staleness bound"


def test_the_console_log_and_chat_lines_carry_the_named_value(caplog):
    event = _event("RLWatchMismatchDrift", 40.0)
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        log_event(event)
    line = caplog.records[-1].getMessage()
    assert "signal=mismatch_kl_k3: drift score 40 robust standard deviations (CUSUM)" in line
    assert "value=" not in line
    assert "drift score 40 robust standard deviations (CUSUM), step 22" in SlackNotifier.text([event])


def test_a_quiet_alert_log_holds_back_the_alert_lines_only(caplog):
    """The demo's live view and a replay print each transition themselves: the alert lines are held back
    while they run, rlwatch's other lines pass, and the alert lines come back afterwards."""
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        with quiet_alert_log():
            log_event(_event("RLWatchKLSpike", 0.2304))
            logging.getLogger("rlwatch").warning("rlwatch: the store is full")
        log_event(_event("RLWatchKLSpike", 0.2304))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "rlwatch: the store is full" and len(lines) == 2
    assert lines[1].startswith("rlwatch alert FIRING RLWatchKLSpike")


def _history(k3: list[float]) -> History:
    return History([(t, {"mismatch_kl_k3": {(): v}}) for t, v in enumerate(k3)], thresholds())


def test_no_forecast_to_a_bound_already_passed():
    """k3 climbing log-linearly from 1e-3, its last steps above kl_k3_max (0.1): the fit's level is still
    below the bound, but k3 is not: nothing is forecast."""
    rng = random.Random(5)
    k3 = [1e-3 * math.exp(0.08 * t) * rng.lognormvariate(0, 0.05) for t in range(38)] + [0.2304, 0.2304]
    assert forecast_steps(_history(k3[:-2]), 0.1) is not None               # below the bound: a forecast
    assert forecast_steps(_history(k3), 0.1) is None


def test_the_kl_spike_description_never_forecasts_its_own_bound():
    text = render(KL_SPIKE.description, {"run": "r"}, 0.2304, {"baseline_ratio": 1.0, "forecast_steps": 84.0})
    assert "at this rate" not in text and "0.2304 nats" in text and "1x its baseline" in text


def test_the_evaluators_spike_line_says_k3_in_nats_without_a_forecast(caplog):
    rng = random.Random(3)
    k3 = [1e-3 * rng.lognormvariate(0, 0.05) for _ in range(40)]
    k3 += [1e-3 * math.exp(0.12 * t) * rng.lognormvariate(0, 0.05) for t in range(1, 60)]
    evaluator = AlertEvaluator("r1", watchdog_interval=0)
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        for step, value in enumerate(k3):
            evaluator.on_step(step, {"mismatch_kl_k3": {(): value}, "step": {(): float(step)}})
    evaluator.close()
    lines = [r.getMessage() for r in caplog.records if "FIRING RLWatch" in r.getMessage()]
    spike = [line for line in lines if "FIRING RLWatchKLSpike" in line]
    assert spike and all(" nats" in line and "at this rate" not in line for line in spike), lines
    assert all("value=" not in line for line in lines), lines


def _policy_kl_lines(caplog, series: list[float], overrides: dict) -> list[str]:
    evaluator = AlertEvaluator("r1", watchdog_interval=0, overrides=overrides)
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        for step, value in enumerate(series):
            evaluator.on_step(step, {"policy_kl": {(): value}, "step": {(): float(step)}})
    evaluator.close()
    return [r.getMessage() for r in caplog.records if "FIRING RLWatchPolicyKLDeparture" in r.getMessage()]


def test_the_policy_kl_departure_forecasts_the_steps_to_policy_kl_max():
    text = render(POLICY_KL.description, {"run": "r"}, 5.0, {"policy_kl_forecast_steps": 12.0})
    assert text.endswith("5x its trailing baseline; at this rate policy_kl_max in ~12 steps."), text
    assert "at this rate" not in render(POLICY_KL.description, {"run": "r"}, 5.0, {})


def test_the_policy_kl_line_forecasts_only_a_bound_not_yet_passed(caplog):
    """The policy KL climbing 6% a step from 0.001 (log-linear from the start, so the 40-step fit sees the
    climb alone): with policy_kl_max 1 nat (above where it departs) the firing line says the steps left
    at its trend, and these agree with the climb; no forecast once the KL is at or above the bound."""
    rng = random.Random(7)
    kl = [0.001 * math.exp(0.06 * t) * rng.lognormvariate(0, 0.05) for t in range(140)]
    lines = _policy_kl_lines(caplog, kl, {"policy_kl_floor": 0.02, "policy_kl_max": 1.0})
    assert lines, "no departure"
    first = re.search(r"step=(\d+).*at this rate policy_kl_max in ~(\d+) steps", lines[0])
    assert first, lines[0]
    step, left = int(first.group(1)), int(first.group(2))
    assert kl[step] < 1.0
    reached = next(t for t in range(step, len(kl)) if kl[t] >= 1.0)
    assert abs(step + left - reached) <= 5, (step, left, reached)      # the trend's own arithmetic
    for line in lines:
        at = int(re.search(r"step=(\d+)", line).group(1))
        assert "policy_kl_max in ~" not in line or kl[at] < 1.0, line


def test_at_the_shipped_defaults_a_departure_past_policy_kl_max_forecasts_nothing(caplog):
    rng = random.Random(8)
    kl = [0.02 * rng.lognormvariate(0, 0.05) for _ in range(60)]
    kl += [0.02 * math.exp(0.12 * t) * rng.lognormvariate(0, 0.05) for t in range(1, 40)]
    lines = _policy_kl_lines(caplog, kl, {})
    bound = thresholds()["policy_kl_max"]
    for line in lines:
        at = int(re.search(r"step=(\d+)", line).group(1))
        assert "policy_kl_max in ~" not in line or sorted(kl[at - 4:at + 1])[2] < bound, line
