"""Issue 14: one step's values are a typed StepValues whose merge follows the catalogue's kinds."""

from __future__ import annotations

import rlwatch
from rlwatch.core.values import StepValues, kind_of, value_of

from tests.conftest import make_step


def test_typed_access_and_set():
    values = StepValues.of({"tokens": {(): 12.0}, "env_episodes": {("math",): 3.0}})
    assert values.value("tokens") == 12.0
    assert values.value("env_episodes", ("math",)) == 3.0
    assert values.value("env_episodes", ("code",)) is None and values.value("nope") is None
    assert values.family("nope") == {} and "nope" not in values
    values.set("env_episodes", 4.0, ("code",))
    assert values["env_episodes"] == {("math",): 3.0, ("code",): 4.0}
    assert StepValues.of(values) is values
    assert value_of({"step": {(): 7.0}}, "step") == 7.0          # any mapping of the same shape


def test_merge_adds_increments_and_replaces_the_rest():
    values = StepValues({
        "episodes_judged_total": {("math", "v"): 4.0, ("code", "v"): None},     # counter
        "token_version_lag": {("0",): 2.0},                                     # histogram buckets
        "token_version_lag_sum": {(): 3.0},                                     # its sum
        "env_reward_mean": {("math",): 0.5, ("code",): 0.1},                    # gauge
        "_group_size_min": {(): 4.0},                                           # internal
    })
    values.merge({
        "episodes_judged_total": {("math", "v"): 2.0, ("code", "v"): 1.0, ("web", "v"): None},
        "token_version_lag": {("0",): 1.0, ("1",): 5.0},
        "token_version_lag_sum": {(): 5.0},
        "env_reward_mean": {("math",): 0.7},
        "_group_size_min": {(): 2.0},
        "drift_score": {("k3", "", ""): 1.5},
    })
    assert values["episodes_judged_total"] == {("math", "v"): 6.0, ("code", "v"): 1.0, ("web", "v"): None}
    assert values["token_version_lag"] == {("0",): 3.0, ("1",): 5.0}
    assert values.value("token_version_lag_sum") == 8.0
    assert values["env_reward_mean"] == {("math",): 0.7}         # a gauge family is the newer source's
    assert values.value("_group_size_min") == 2.0
    assert values.value("drift_score", ("k3", "", "")) == 1.5
    assert [kind_of(n) for n in ("steps_total", "tokens", "token_version_lag_sum", "_x")] == [
        "counter", "gauge", "counter", None]


class _AddsTokens:
    """A user listener that returns counter increments for a family the step already carries."""

    def on_step(self, step, values):
        assert isinstance(values, StepValues)
        return {"tokens_total": {(): 5.0}, "framework_metric": {("extra",): 1.0}}

    def close(self):
        pass


def test_the_pipeline_merges_what_listeners_return_by_kind():
    step = make_step(B=4, T=4)
    with rlwatch.Watch(run="v", port=None, store=None, alerts=False, listeners=(_AddsTokens(),)) as watch:
        values = watch.observe(0, **step)
        tokens = float(step["mask"].sum())
        assert isinstance(values, StepValues)
        assert values.value("tokens") == tokens
        assert values.value("tokens_total") == tokens + 5.0        # added, not replaced by the listener's 5
        assert watch.state.snapshot().counters["tokens_total"][()] == tokens + 5.0
