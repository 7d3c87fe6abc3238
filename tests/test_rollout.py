"""The rollout-system signals (docs/rollout-system.md): episode durations per environment with their
tail and histogram, the straggler wait, phases (``phases=`` and ``watch.phase``), launched versus
trained per environment and reason with the length bias, the per-episode sample kept in the store,
and the labelled duration histogram in the exposition. Every value is checked against a plain
reference (``torch.quantile``, Python counts) on random steps."""

from __future__ import annotations

import math
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import rlwatch
from rlwatch.core.errors import HookErrors
from rlwatch.core.metrics import DURATION_BUCKETS, DURATION_SAMPLE_MAX
from rlwatch.core.record import RecordBuilder
from rlwatch import compute
from rlwatch.signals import SignalConfig, Workspace, compute_step
from rlwatch.runs.store import StoreReader

from tests.conftest import host_reads


def _random_step(seed: int, B: int, envs: tuple[str, ...] = ("math", "code", "web")) -> dict:
    g = torch.Generator().manual_seed(seed)
    durations = torch.exp(torch.randn(B, generator=g, dtype=torch.float64) * 1.2 + 3.5)     # log-normal, s
    durations[torch.rand(B, generator=g) < 0.1] = math.nan                                 # unknown
    lengths = torch.randint(1, 17, (B,), generator=g)
    mask = torch.arange(16)[None] < lengths[:, None]
    env = [envs[i] for i in torch.randint(0, len(envs), (B,), generator=g).tolist()]
    return dict(mask=mask, durations=durations, env=env)


def _tail(d: torch.Tensor) -> dict[str, float]:
    d = d[~d.isnan()]
    q = torch.quantile(d, torch.tensor([0.5, 0.95], dtype=torch.float64))
    return {"mean_seconds": d.mean().item(), "p50_seconds": q[0].item(), "p95_seconds": q[1].item(),
            "max_seconds": d.max().item(), "max_over_mean": (d.max() / d.mean()).item()}


@pytest.mark.parametrize("seed,B", [(0, 1), (1, 7), (2, 64), (3, 300), (4, 1000)])
def test_duration_tail_histogram_and_straggler_per_environment(seed, B):
    step = _random_step(seed, B)
    v = compute(**step)
    d = step["durations"]
    want = _tail(d)
    for key, value in want.items():
        assert v[f"episode_duration_{key}"][()] == pytest.approx(value, rel=1e-12)
    assert v["straggler_wait_seconds"][()] == pytest.approx(want["max_seconds"] - want["p50_seconds"], rel=1e-12)
    for name in set(step["env"]):
        sel = torch.tensor([e == name for e in step["env"]])
        if (~d[sel].isnan()).sum() == 0:
            assert (name,) not in v.get("env_episode_duration_mean_seconds", {})
            continue
        for key, value in _tail(d[sel]).items():
            assert v[f"env_episode_duration_{key}"][(name,)] == pytest.approx(value, rel=1e-12)
        known = d[sel][~d[sel].isnan()]
        edges = (-math.inf, *DURATION_BUCKETS, math.inf)
        for k, (lo, hi) in enumerate(zip(edges, edges[1:])):
            label = str(DURATION_BUCKETS[k]) if k < len(DURATION_BUCKETS) else "+Inf"
            count = ((known > lo) & (known <= hi)).sum().item()
            assert v["episode_duration_seconds"][(name, label)] == count, (name, label)
        assert v["episode_duration_seconds_sum"][(name,)] == pytest.approx(known.sum().item())
    sample = v["episode_duration_sample_seconds"]
    kept = [i for i in range(B) if not math.isnan(d[i])]
    if B <= DURATION_SAMPLE_MAX:
        assert sample == {("trained", step["env"][i], str(i)): d[i].item() for i in kept}
    else:
        assert len(sample) <= DURATION_SAMPLE_MAX and ("trained", step["env"][0], "0") in sample or math.isnan(d[0])
        assert all(value == d[int(index)].item() for (_, _, index), value in sample.items())


def test_launched_versus_trained_by_reason_and_the_length_bias():
    """Dropping the long failures and timeouts shortens the trained data: the ratios say by how much."""
    trained = [10.0, 20.0, 30.0, 40.0]
    dropped = [200.0, 100.0, math.nan]
    v = compute(mask=torch.ones(4, 8), durations=trained, env=["a", "a", "b", "b"],
                dropped_reasons=["timeout", "failure", "something else"], dropped_durations=dropped,
                dropped_lengths=[8, 4, None], dropped_env=["a", "b", "b"])
    assert v["episodes_trained_total"] == {("a",): 2.0, ("b",): 2.0}
    assert v["episodes_dropped_total"] == {("a", "timeout"): 1.0, ("b", "failure"): 1.0, ("b", "other"): 1.0}
    assert v["episodes_launched_total"] == {("a",): 3.0, ("b",): 4.0}
    assert v["trained_episode_duration_mean_seconds"][()] == 25.0
    assert v["launched_episode_duration_mean_seconds"][()] == pytest.approx(400.0 / 6)
    assert v["length_bias_duration_ratio"][()] == pytest.approx(25.0 / (400.0 / 6))
    assert v["trained_response_length_mean"][()] == 8.0
    assert v["launched_response_length_mean"][()] == pytest.approx(44.0 / 6)
    assert v["length_bias_length_ratio"][()] == pytest.approx(8.0 / (44.0 / 6))
    sample = v["episode_duration_sample_seconds"]
    assert sample[("timeout", "a", "0")] == 200.0 and sample[("failure", "b", "1")] == 100.0
    assert ("other", "b", "2") not in sample                       # unknown duration: not kept
    # Nothing dropped (an empty list): launched = trained, ratio 1; without the field no such series.
    v = compute(mask=torch.ones(4, 8), durations=trained, dropped_reasons=[])
    assert v["length_bias_duration_ratio"][()] == 1.0 and v["episodes_launched_total"] == {("default",): 4.0}
    v = compute(mask=torch.ones(4, 8), durations=trained)
    assert "episodes_launched_total" not in v and "length_bias_duration_ratio" not in v


def test_bad_rollout_fields_are_counted_and_dropped_not_raised():
    errors = HookErrors(strict=False)
    record = RecordBuilder(errors).build(0, dict(mask=torch.ones(3, 4), durations=[1.0, 2.0],
                                                 phases={"sync": -1.0, "generation": "x", "training": 2.0},
                                                 dropped_reasons=7))
    assert record.rollout.durations is None and record.rollout.phases == {"training": 2.0}
    assert record.rollout.dropped is None and errors.total() == 4
    record = RecordBuilder(errors).build(0, dict(mask=torch.ones(3, 4), durations=[1.0, -5.0, math.inf]))
    assert record.rollout.durations[0] == 1.0 and record.rollout.durations[1:].isnan().all()


def test_episode_durations_from_the_episodes_api():
    eps = [rlwatch.hacks.Episode(env="a", reward=1.0, duration=float(i + 1)) for i in range(4)]
    with rlwatch.Watch(run="eps", port=None, store=None, strict=True, hack_detectors=False) as watch:
        v = watch.observe(0, mask=torch.ones(4, 2), env=["a"] * 4, episodes=eps)
    assert v["episode_duration_max_seconds"][()] == 4.0 and v["straggler_wait_seconds"][()] == 1.5


def test_one_host_synchronisation_with_durations_and_dropped_episodes(monkeypatch):
    step = _random_step(5, 32)
    step.update(dropped_reasons=["stale"] * 3, dropped_durations=torch.tensor([1.0, 2.0, 3.0]),
                dropped_lengths=torch.tensor([3, 4, 5]), phases={"sync": 1.0})
    ws = Workspace()
    record = RecordBuilder(HookErrors(strict=True)).build(0, step, ws)
    calls = host_reads(monkeypatch)
    values = compute_step(record, SignalConfig(), ws)
    monkeypatch.undo()
    assert calls == ["tolist"], calls
    assert values["weight_sync_seconds"][()] == 1.0


def test_phases_stored_and_the_histogram_exported_per_environment(tmp_path):
    store = str(tmp_path / "run.db")
    with rlwatch.Watch(run="roll", port=0, store=store, strict=True) as watch:
        with watch.phase("sync"):
            time.sleep(0.02)
        with watch.phase("generation"):
            pass
        watch.observe(1, mask=torch.ones(4, 3), durations=[1.5, 2.5, 40.0, 700.0], env=["a", "a", "b", "b"],
                      phases={"generation": 9.0, "training": 3.0})
        watch.observe(2, mask=torch.ones(2, 3), durations=[3.0, 4.0], env=["a", "b"])
        url = watch.url
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        watch.flush()
    with StoreReader(store) as reader:
        rows = {row.step: row for row in reader.steps("roll")}
    first = rows[1]
    assert first.get("phase_seconds", ("generation",)) == 9.0          # the step's own value wins
    assert first.get("phase_seconds", ("training",)) == 3.0
    assert 0.02 <= first.get("weight_sync_seconds") == first.get("phase_seconds", ("sync",)) < 1.0
    assert rows[2].get("phase_seconds", ("sync",)) is None                # the clock was emptied
    assert first.get("episode_duration_seconds", ("b", "1200")) == 1.0
    assert first.get("episode_duration_sample_seconds", ("trained", "b", "3")) == 700.0
    buckets = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "rlwatch_episode_duration_seconds_bucket":
                buckets[(s.labels["env"], s.labels["le"])] = s.value
            if s.name == "rlwatch_episode_duration_seconds_count":
                buckets[(s.labels["env"], "count")] = s.value
    assert buckets[("a", "2.0")] == 1 and buckets[("a", "5.0")] == 3 and buckets[("a", "count")] == 3
    assert buckets[("b", "5.0")] == 1 and buckets[("b", "60.0")] == 2 and buckets[("b", "+Inf")] == 3
    assert "rlwatch_episode_duration_sample_seconds" not in text           # stored, never exported
    assert "rlwatch_phase_seconds_total" in text


def test_postmortem_names_a_duration_tail_and_a_sync_change_among_first_movers(tmp_path):
    """Steady run; at step 30 the duration tail grows (a slow environment joins) and at step 35 the weight
    sync slows down; quality collapses at 45. Both changes are first movers, dated where they happened;
    the lag and mismatch never move. Wall-clock signals are not compared between runs."""
    from rlwatch.postmortem import analyse, load
    from rlwatch.postmortem.compare import compare

    from tests.conftest import make_step

    path = str(tmp_path / "pm.db")
    g = torch.Generator().manual_seed(0)
    with rlwatch.Watch(run="tail", port=None, store=path) as w:
        for step in range(60):
            rec = make_step(B=32, T=16, seed=step, noise=0.02)
            d = torch.exp(torch.randn(32, generator=g, dtype=torch.float64) * 0.3) * 60
            if step >= 30:
                d[:4] *= 8                                           # the new tail
            quality = 0.8 if step < 45 else 0.05
            rec.update(rewards=torch.full((32,), quality), durations=d,
                       phases={"sync": (12.0 if step >= 35 else 2.0) + 0.1 * float(torch.rand(1, generator=g))})
            w.observe(step, **rec)
            w.log_scalars(step, {"heldout_true_reward": quality})
    report = analyse(load(path))
    first = {c.signal: c for c in report.first_signals}
    assert 29 <= first["episode_duration_p95_seconds"].step <= 31 and first["episode_duration_p95_seconds"].lead > 0
    assert 34 <= first["weight_sync_seconds"].step <= 36
    assert "straggler_wait_seconds" in first
    assert "version_lag_max" not in first
    same = compare(load(path), load(path))
    assert "episode_duration_p95_seconds" not in same.compared and "weight_sync_seconds" not in same.compared
    assert "reward_mean" in same.compared


def test_opentelemetry_exports_the_duration_histogram_as_prometheus_does():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prometheus_client import CollectorRegistry

    from rlwatch.exporters.prometheus import RLWatchCollector

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with rlwatch.Watch(run="otel", port=None, store=None, otel=provider, alerts=False) as watch:
        watch.observe(0, mask=torch.ones(3, 2), durations=[0.5, 90.0, 5000.0], env=["a", "b", "b"])
        otel = {(point.attributes["env"], point.attributes["le"]): point.value
                for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                for metric in sm.metrics if metric.name == "rlwatch_episode_duration_seconds_episodes"
                for point in metric.data.data_points}
        registry = CollectorRegistry()
        registry.register(RLWatchCollector(watch.state))
        prom = {(s.labels["env"], s.labels["le"]): s.value for family in registry.collect() for s in family.samples
                if s.name == "rlwatch_episode_duration_seconds_bucket"}
    provider.shutdown()
    assert otel == prom and prom[("a", "1.0")] == 1 and prom[("b", "120.0")] == 1 and prom[("b", "+Inf")] == 2
