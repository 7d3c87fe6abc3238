"""The mismatch diagnosis on step values of known shape (per-lag levels, lag histories), and its
labelled evaluation: the committed report (docs/diagnosis-evaluation.md) matches what the code
gives on a reduced set of its test runs, trained again here."""

from __future__ import annotations

import re

import pytest

from rlwatch.analyses.diagnosis import THRESHOLDS, diagnose


def step(version: int, levels: dict[int, float], tokens: float = 400.0, signed: float | None = None,
         slope: float = 0.0) -> dict:
    """One step's values: mean |log-ratio| ``levels`` by lag bucket, ``tokens`` per bucket."""
    total = tokens * len(levels)
    mean = sum(levels.values()) / len(levels)
    return {"mismatch_abs_log_ratio_mean": {(): mean},
            "mismatch_log_ratio_mean": {(): 0.0 if signed is None else signed},
            "mismatch_log_ratio_slope": {(): slope},
            "mismatch_abs_log_ratio_mean_by_lag": {(str(lag),): v for lag, v in levels.items()},
            "mismatch_tokens_by_lag": {(str(lag),): tokens for lag in levels},
            "version_lag_mean": {(): sum(levels) / len(levels)}, "version_lag_max": {(): float(max(levels))},
            "trainer_version": {(): float(version)}, "tokens": {(): total}}


def constant_lag(lag: int, steps: int, floor: float, per_lag: float) -> list[dict]:
    """A sampler ``lag`` updates behind from the start: lag min(step, lag), mismatch floor + per_lag * lag."""
    return [step(v, {min(v, lag): floor + per_lag * min(v, lag)}) for v in range(steps)]


def test_on_policy_without_mismatch_is_none():
    d = diagnose([step(v, {0: 1e-7}) for v in range(10)])
    assert d.causes == ["none"] and "below the floor" in d.evidence[0]


def test_a_lag_0_floor_is_numeric_noise_with_evidence_that_says_so():
    d = diagnose([step(v, {0: 0.02}, signed=0.001) for v in range(10)])
    assert d.causes == ["numeric_noise"]
    assert any("at lag 0" in e for e in d.evidence) and any(e.startswith("zero-mean") for e in d.evidence)
    one_signed = diagnose([step(v, {0: 0.02}, signed=-0.015) for v in range(10)])
    assert not any(e.startswith("zero-mean") for e in one_signed.evidence)      # never said where untrue


def test_rescued_shape_is_staleness_not_numeric_noise():
    """The demo's rescued run: lag 8 on every token after warm-up, a one-signed, large mismatch."""
    steps = constant_lag(8, 30, 0.0, 0.09)
    for s in steps:
        s["mismatch_log_ratio_mean"] = {(): -0.8 * s["mismatch_abs_log_ratio_mean"][()]}
    d = diagnose(steps, staleness_bound=2)
    assert d.causes == ["stale_weights"], d.evidence
    assert "grows with the version lag" in d.evidence[0] and not any("zero-mean" in e for e in d.evidence)


def test_a_collapse_run_of_12_steps_is_stale_weights_and_a_missing_sync_is_named():
    assert diagnose(constant_lag(8, 12, 0.0, 0.09), staleness_bound=2).causes == ["stale_weights"]
    missing = [step(v, {max(0, v - 2): 0.09 * max(0, v - 2)}) for v in range(12)]
    assert diagnose(missing, staleness_bound=2).causes == ["weight_sync_missing"]


def test_a_mixture_names_both_the_larger_first():
    big_stale = diagnose(constant_lag(4, 12, 0.01, 0.1))
    assert big_stale.causes == ["stale_weights", "numeric_noise"] and big_stale.name == \
        "stale_weights + numeric_noise"
    big_noise = diagnose([step(v, {0: 0.2, 1: 0.2 + 0.05}) for v in range(12)])
    assert big_noise.causes == ["numeric_noise", "stale_weights"]


def test_thresholds_and_confidence_come_from_the_tuning_split():
    d = diagnose(constant_lag(4, 12, 0.0, 0.1))
    assert d.accuracy is not None and 0 < d.accuracy <= 1 and d.confidence in ("low", "medium", "high")


# --- the evaluation ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_committed_evaluation_report_matches_the_code():
    from evaluation import diagnosis_eval as ev

    text = ev.REPORT.read_text()
    assert ", ".join(f"`{k}` {v:g}" for k, v in THRESHOLDS.items()) in text
    accuracy = re.search(r"## Test split: (\d+)/(\d+) right", text)
    assert accuracy and int(accuracy.group(1)) >= 0.9 * int(accuracy.group(2))
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (diagnosis-\S+) \| [^|]+ \| ([^|]+?) \|", text, re.M)}
    reduced = [ev.EvalRun("gru", s, ev.TEST_SEEDS[0], ev.SETTINGS["steps"]) for s in ("on_policy_clean", "lag2")]
    for spec, verdict in zip(reduced, ev.verdict_rows(ev.run_features(ev.collect_runs(reduced, None, 1)))):
        assert rows[spec.name] == verdict["verdict"] + ("" if verdict["right"] else " (wrong)"), spec.name
