"""Watch end to end: what the real HTTP endpoint and the store export (values, counters and stale
gauges, promtool's check of the exposition), and bad input, hook and listener errors counted, never raised."""

from __future__ import annotations

import logging
import subprocess
import urllib.request

import pytest
import torch

import rlwatch
from rlwatch import InvalidFieldError
from rlwatch.runs.store import StoreReader

from .conftest import make_step, need_binary
from ._watch_helpers import sample, scrape


def test_scraped_values_match_the_observed_record(tmp_path):
    step = make_step(B=16, T=32, seed=5)
    with rlwatch.Watch(run="e2e", port=0, store=str(tmp_path / "s.db"), strict=True) as watch:
        values = watch.observe(3, **step)
        samples = scrape(watch.url)
        assert watch.url.startswith("http://127.0.0.1:")
        r = (step["trainer_logp"] - step["sampler_logp"])[step["mask"]].double()
        k3 = float((torch.expm1(r) - r).mean())
        assert sample(samples, "rlwatch_mismatch_kl_k3", run="e2e") == pytest.approx(k3, rel=1e-5)
        assert sample(samples, "rlwatch_step", run="e2e") == 3
        assert sample(samples, "rlwatch_tokens_total", run="e2e") == int(step["mask"].sum())
        lag = (10 - step["token_version"])[step["mask"]]
        assert sample(samples, "rlwatch_token_version_lag_bucket", run="e2e", le="2.0") == int((lag <= 2).sum())
        assert sample(samples, "rlwatch_token_version_lag_count", run="e2e") == lag.numel()
        assert sample(samples, "rlwatch_token_version_lag_sum", run="e2e") == int(lag.sum())
        rewards = step["rewards"]
        math_reward = float(rewards[0::2].mean())
        assert sample(samples, "rlwatch_env_reward_mean", run="e2e", env="math") == pytest.approx(math_reward)
        # Every exported value equals the value observe() returned.
        for name, family in values.items():
            spec = rlwatch.core.metrics.BY_NAME.get(name)
            if spec is None or spec.kind != "gauge":
                continue
            for labels, value in family.items():
                if value is not None:
                    key = dict(zip(("run", *spec.labels), ("e2e", *labels)))
                    assert sample(samples, spec.full_name, **key) == pytest.approx(value), name
        watch.flush()
    with StoreReader(str(tmp_path / "s.db")) as store:
        row = store.steps("e2e")[0]
        assert row.step == 3
        assert row.get("mismatch_kl_k3") == pytest.approx(k3, rel=1e-5)
        assert store.meta("e2e")["framework"] == "custom"


def test_counters_accumulate_and_gauges_go_stale(tmp_path):
    with rlwatch.Watch(run="acc", port=0, store=None, strict=True) as watch:
        a, b = make_step(seed=1), make_step(seed=2)
        watch.observe(0, **a)
        watch.observe(1, mask=b["mask"])    # no log-probs this step
        samples = scrape(watch.url)
        assert sample(samples, "rlwatch_tokens_total", run="acc") == int(a["mask"].sum() + b["mask"].sum())
        assert sample(samples, "rlwatch_steps_total", run="acc") == 2
        assert ("rlwatch_mismatch_kl_k3", (("run", "acc"),)) not in samples   # not computed at step 1
        assert sample(samples, "rlwatch_is_cap", run="acc") == 2.0             # settings persist


def test_exposition_passes_promtool(tmp_path):
    promtool = need_binary("promtool")
    with rlwatch.Watch(run='quote"run', port=0, store=None) as watch:
        step = make_step(seed=4)
        step.update(env=['a"b', "new\nline"] * 8, hacked={"verifier": torch.ones(16, dtype=torch.bool)},
                    failed=[None] * 15 + ["timeout"], entropy=torch.rand(16, 32), temperature=0.6,
                    logprobs_mode="processed_logprobs")
        watch.observe(0, **step)
        watch.log_scalars(0, {"actor/grad_norm": 2.0, "weird name {x}": 1.0})
        text = urllib.request.urlopen(watch.url).read()
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bad_input_never_raises_by_default(caplog):
    caplog.set_level(logging.WARNING, logger="rlwatch")
    with rlwatch.Watch(run="bad", port=None, store=None) as watch:
        step = make_step()
        step["sampler_logp"] = torch.zeros(3, 3)       # wrong shape: dropped, rest still computed
        step["rewards"] = "not numbers"
        values = watch.observe(0, **step)
        assert values is not None and "version_lag_mean" in values and "mismatch_kl_k3" not in values
        assert watch.observe(1, mask=None) is None
        watch.observe(2, **step)
        counts = watch.errors.counts
        assert counts[("validate", "shape")] == 2 and counts[("validate", "missing")] == 1
        messages = [r.getMessage() for r in caplog.records]
        assert sum("(shape)" in m for m in messages) == 1          # logged once per kind
        assert any("sampler_logp" in m for m in messages)
    with rlwatch.Watch(run="strict", port=None, store=None, strict=True) as watch:
        with pytest.raises(InvalidFieldError) as info:
            watch.observe(0, **step)
        assert info.value.field == "sampler_logp"


def test_hook_errors_are_exported(tmp_path):
    with rlwatch.Watch(run="err", port=0, store=None) as watch:
        watch.observe(0, mask=torch.ones(2, 2), sampler_logp=torch.zeros(2, 3), trainer_logp=torch.zeros(2, 2))
        samples = scrape(watch.url)
        assert sample(samples, "rlwatch_hook_errors_total", run="err", stage="validate", kind="shape") == 1


def test_a_failing_listener_is_counted_under_its_own_stage_and_the_step_still_exports(monkeypatch):
    from rlwatch.analyses.diagnosis import Diagnoser
    from rlwatch.analyses.drift import DriftDetector

    def fails(self, step, values):
        raise RuntimeError(f"{type(self).__name__} failed")

    class Broken:
        on_step = fails

        def close(self):
            raise OSError("close failed")

    monkeypatch.setattr(DriftDetector, "on_step", fails)
    monkeypatch.setattr(Diagnoser, "on_step", fails)
    with rlwatch.Watch(run="stages", port=0, store=None, alerts=True, listeners=(Broken(),)) as watch:
        watch.observe(4, **make_step(seed=2))
        samples = scrape(watch.url)
    for stage in ("drift", "diagnosis", "listener"):
        assert sample(samples, "rlwatch_hook_errors_total", run="stages", stage=stage, kind="RuntimeError") == 1
    assert watch.errors.snapshot() == {("drift", "RuntimeError"): 1, ("diagnosis", "RuntimeError"): 1,
                                       ("listener", "RuntimeError"): 1, ("listener", "close"): 1}
    assert sample(samples, "rlwatch_step", run="stages") == 4
    assert ("rlwatch_mismatch_kl_k3", (("run", "stages"),)) in samples
    assert any(name == "rlwatch_alert_value" for name, _ in samples)    # the alert windows ran after them


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_an_invalid_token_version_is_left_out_of_the_lag_and_counted_never_paged(bad):
    """One NaN (or infinite, or negative) version among 256 with trainer_version 1000: on main NaN
    became version 0, a lag of 1000 and a critical RLWatchVersionLagFarAboveBound; now the token is
    left out of the lag signals and counted as a validate error."""
    B, T = 16, 16
    fields = make_step(B=B, T=T, lag_max=0, noise=0.0)
    fields["mask"] = torch.ones(B, T, dtype=torch.bool)
    version = torch.full((B, T), 999.0)
    version[3, 5] = bad
    fields.update(token_version=version, trainer_version=1000)
    with rlwatch.Watch(run="versions", port=None, store=None, alerts=True, staleness_bound=2) as watch:
        for step in range(4):
            values = watch.observe(step, **fields)
        assert values.value("version_lag_max") == 1.0
        assert values.value("version_lag_mean") == pytest.approx(1.0)
        assert watch.errors.counts[("validate", "negative_lag")] == 4
        assert [e.name for e in watch.evaluator.events] == []
