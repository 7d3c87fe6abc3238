"""The project's scenario suite, 5 seeds each: a critical alert before every collapse, none in a
healthy run, the hack-rate alert for the buggy environment only; and the mismatch diagnosis on
faults injected into scenario runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlwatch.demo.acceptance import HEALTHY, accepted, run_suite, table, verdict

pytestmark = pytest.mark.slow


def test_alert_acceptance_suite_five_seeds():
    outcomes = run_suite(seeds=5, jobs=2)
    print(table(outcomes))
    v = verdict(outcomes)
    assert v["collapse_scenario_collapsed"] == v["collapse_scenario_runs"] == 5
    assert v["healthy_collapsed"] == 0
    assert v["paged_before_collapse"] == v["collapsing_runs"] and v["lead_min"] > 0
    assert v["false_alarms"] == 0
    assert v["hack_alert_buggy_env_only"] == v["hack_runs"] == 5
    assert accepted(v)
    assert all(not o.critical_alerts for o in outcomes if o.scenario in HEALTHY)


def bf16_like_noise(fields: dict, seed: int) -> dict:
    """Numeric noise as a bf16 sampler makes it: zero-mean, larger on low-probability tokens."""
    import torch

    s = fields["sampler_logp"]
    g = torch.Generator().manual_seed(seed)
    noise = 0.03 * (1.0 - s.exp()) * torch.randn(s.shape, generator=g)
    return {**fields, "sampler_logp": s + noise}


def _diagnose(scenario: str, seed: int = 0, noise: bool = False, **overrides) -> str:
    import rlwatch
    from rlwatch.demo import WATCH_CONFIG
    from rlwatch.demo.scenario import SCENARIOS, run_scenario

    config = replace(SCENARIOS[scenario], seed=seed, **overrides)
    with rlwatch.Watch(run=scenario, port=None, store=None, **WATCH_CONFIG) as watch:
        def on_step(info):
            watch.observe(info.step, **(bf16_like_noise(info.fields, info.step) if noise else info.fields))
        run_scenario(config, on_step=on_step)
        diagnoser = next(l for l in watch.listeners if type(l).__name__ == "Diagnoser")
        return diagnoser.latest


@pytest.mark.parametrize("scenario,overrides,cause", [
    ("collapse", {}, "stale_weights"),
    ("temperature_fault", {"steps": 12}, "temperature_mismatch"),
    ("top_p_fault", {"steps": 12}, "top_p_truncation"),
    ("healthy", {"steps": 12}, "none"),
    ("healthy", {"steps": 12, "noise": True}, "numeric_noise"),
    ("healthy", {"steps": 40, "lag": 1000}, "weight_sync_missing"),     # the sampler never gets new weights
])
def test_diagnosis_names_the_injected_fault(scenario, overrides, cause):
    diagnosis = _diagnose(scenario, **overrides)
    assert diagnosis.cause == cause, (diagnosis.cause, diagnosis.evidence)
    assert diagnosis.evidence
