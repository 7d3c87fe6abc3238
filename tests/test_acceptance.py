"""The alert acceptance report on a small sample of the scenario matrix (the full report, 216 runs,
is `python -m evaluation.acceptance`, committed as alerts/acceptance.md): no critical page on a
healthy run, a page before a collapse, a semantic fault critical at once and for as long as it
lasts, no flap, and Prometheus' rule engine deciding the same alerts at every step as the
embedded evaluator; and the mismatch diagnosis on faults injected into scenario runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from evaluation.acceptance import bars, prometheus_agrees, replay, score
from evaluation.matrix import RunSpec, collect_all

from tests.conftest import need_binary

pytestmark = pytest.mark.slow

SAMPLE = [RunSpec("gru", scenario, 3) for scenario in ("healthy_lag2", "collapse_lag8", "temperature", "hack")]


def test_alert_acceptance_on_a_sample_of_the_matrix(tmp_path):
    from rlwatch.demo import WATCH_CONFIG

    need_binary("promtool")
    traces = collect_all(SAMPLE, str(tmp_path), jobs=2)
    overrides = WATCH_CONFIG["alert_overrides"]
    outcomes = [replay(t, overrides) for t in traces]
    s = score(outcomes)
    assert s["healthy_runs"] == 1 and s["healthy_critical_pages"] == 0, s
    assert s["collapsed"] == s["collapsed_paged_before"], s
    assert s["semantic_ok"] == s["semantic_runs"] == 1, s
    assert s["flaps"] == 0, s
    failed = [name for name, ok in bars(s).items() if not ok]
    assert failed == [], (failed, s)
    agreement = prometheus_agrees(traces, overrides)
    assert agreement["ok"] and agreement["steps"] == sum(len(t["steps"]) for t in traces), agreement


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
        diagnoser = next(x for x in watch.listeners if type(x).__name__ == "Diagnoser")
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
