"""``rlwatch whatif``: the pipeline simulation against closed forms and the reference chapter's
figures, and the command on a run store written with the rollout-system signals' keys."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlwatch.ops.cli import main
from rlwatch.runs.store import RunStore
from rlwatch.whatif.chapter import reproduce
from rlwatch.whatif.measured import load
from rlwatch.whatif.model import DurationModel
from rlwatch.whatif.report import build
from rlwatch.whatif.simulate import ONE_STEP_AHEAD, SYNCHRONOUS, Pipeline, asynchronous, episodes_needed, simulate


def test_constant_durations_give_the_closed_form_of_each_design():
    # synchronous: every step is duration + train + sync; slots busy duration / step
    p = Pipeline(slots=4, batch_size=4, train_s=6.0, sync_s=2.0, steps=5)
    sync = simulate([10.0] * 100, p, SYNCHRONOUS)
    assert sync.seconds == pytest.approx(5 * 18.0)
    assert sync.throughput == pytest.approx(20 / 90 * 3600)
    assert sync.utilisation == pytest.approx(10 / 18)
    assert (sync.staleness_mean, sync.staleness_max) == (0.0, 0)
    # one step ahead with draining: the second batch starts with the first step's training (10 .. 16)
    # and its sync waits for it (20 .. 22); from then on training hides under generation: 10 + 2 a step
    ahead = simulate([10.0] * 100, p, ONE_STEP_AHEAD)
    assert ahead.seconds == pytest.approx(22 + 4 * 12)
    assert ahead.staleness_max == 1


def test_partial_rollouts_pause_in_flight_episodes_during_a_sync():
    # one slot, one episode per step, eta 1: the second episode starts at 0+10 and is paused by the
    # first step's sync (10+6 .. 18), so it ends at 22 instead of 20
    p = Pipeline(slots=1, batch_size=1, train_s=6.0, sync_s=2.0, steps=2)
    out = simulate([10.0, 10.0, 10.0], p, asynchronous(1, partial=True))
    assert out.seconds == pytest.approx(22 + 6 + 2)
    assert out.utilisation == pytest.approx(22 / 30)        # the pause counts as busy
    drain = simulate([10.0, 10.0, 10.0], p, asynchronous(1, partial=False))
    # draining: each sync waits for the in-flight episode (20, then 32), and nothing starts meanwhile
    assert drain.seconds == pytest.approx(20 + 2 + 10 + 2)


def test_exponential_durations_give_the_harmonic_straggler_wait():
    # the chapter's exercise 1: E[max of B exponentials of mean m] = m * H_B
    m, batch, steps = 50.0, 16, 400
    gen = torch.Generator().manual_seed(3)
    draws = torch.empty(steps * batch, dtype=torch.float64).exponential_(1 / m, generator=gen)
    out = simulate(draws.tolist(), Pipeline(batch, batch, 0.0, 0.0, steps), SYNCHRONOUS)
    harmonic = sum(1 / k for k in range(1, batch + 1))
    assert out.seconds / steps == pytest.approx(m * harmonic, rel=0.05)


def test_running_out_of_durations_says_how_many_are_needed():
    p = Pipeline(slots=2, batch_size=2, steps=3)
    with pytest.raises(ValueError, match=str(episodes_needed(p, asynchronous(2, True)))):
        simulate([5.0] * 4, p, asynchronous(2, partial=True))


def test_the_chapters_figures_are_reproduced_within_ten_percent():
    figures = reproduce()
    assert len(figures) >= 45
    wrong = [(f.what, f.chapter, round(f.reproduced, 3)) for f in figures if f.error > 0.10]
    assert not wrong
    by_name = {f.what: f.reproduced for f in figures}
    assert by_name["async eta=1, partial: staleness max"] == 5
    assert by_name["async eta=2, partial: staleness max"] == 7


def test_the_duration_model_has_the_chapters_shape_on_another_seed():
    d = DurationModel().sample(65_536, seed=7).double()
    assert d.mean().item() == pytest.approx(96, rel=0.03)
    assert d.median().item() == pytest.approx(68, rel=0.03)
    assert d.quantile(0.99).item() == pytest.approx(430, rel=0.05)


# --- a run store with the rollout-system keys (docs/rollout-system.md) ------------------------------

LAG_K3 = {"0": 0.002, "1": 0.012, "2": 0.022, "3": 0.032}


def write_run(path, steps: int = 12, batch: int = 16, durations: bool = True, lag: bool = True,
              bound_in_meta: bool = False, lag_mean: float = 1.4, lag_max: float = 3.0, scale: float = 0.1) -> None:
    """A store of an asynchronous run (eta 2, partial rollouts), batch of ``batch`` episodes, 2 s
    training, 1 s sync, episodes from the chapter's duration model scaled by ``scale``; k3 rising by
    0.01 per version of lag; version lag mean ``lag_mean``, max ``lag_max`` (5 at step 7)."""
    pool = (DurationModel().sample(steps * batch, seed=11) * scale).tolist()
    store = RunStore(str(path))
    store.submit_run("async-run", {"framework": "custom", "config": {"staleness_bound": 2}} if bound_in_meta
                     else {"framework": "custom"})
    for step in range(steps):
        values = {"sequences": {(): float(batch)}, "step_interval_seconds": {(): 25.0},
                  "phase_seconds": {("training",): 2.0, ("sync",): 1.0, ("generation",): 22.0}}
        if not bound_in_meta:
            values["staleness_bound"] = {(): 2.0}
        if durations:
            values["episode_duration_sample_seconds"] = {
                ("trained", "math", str(i)): pool[step * batch + i] for i in range(batch)}
        if lag:
            values.update({"version_lag_mean": {(): lag_mean},
                           "version_lag_max": {(): max(lag_max, 5.0 if step == 7 else lag_max)},
                           "partial_rollout_ratio": {(): 0.2},
                           "mismatch_kl_k3_by_lag": {(k,): v for k, v in LAG_K3.items()},
                           "mismatch_tokens_by_lag": {(k,): 1000.0 for k in LAG_K3}})
        store.submit_step("async-run", step, values)
    assert store.flush()
    store.close()


def test_the_store_loader_reads_the_agreed_keys(tmp_path):
    write_run(tmp_path / "run.db")
    m = load(str(tmp_path / "run.db"))
    assert (m.batch_size, m.train_s, m.sync_s, m.staleness_bound, m.partial) == (16, 2.0, 1.0, 2.0, True)
    assert len(m.trained_durations) == 12 * 16 and m.staleness_max == 5.0
    assert m.throughput == pytest.approx(16 / 25 * 3600)
    assert (m.interval_s, m.unphased_s) == (25.0, 0.0)          # 22 s generation + 2 s training + 1 s sync
    assert m.lag_cost.slope == pytest.approx(0.01)
    assert m.lag_cost.at(1.5)[0] == pytest.approx(0.017)
    assert m.lag_cost.at(7)[0] == pytest.approx(0.072) and m.lag_cost.at(7)[1]


def test_the_staleness_bound_is_read_from_the_runs_metadata_without_its_gauge(tmp_path):
    write_run(tmp_path / "run.db", bound_in_meta=True)
    assert build(load(str(tmp_path / "run.db"))).own == asynchronous(2, partial=True)


def test_the_recommendation_weighs_throughput_against_k3_per_version(tmp_path):
    write_run(tmp_path / "run.db")
    m = load(str(tmp_path / "run.db"))
    loose = build(m, k3_bound=0.1)
    assert loose.own == asynchronous(2, partial=True)
    assert loose.recommended.design.partial and loose.recommended.design.eta >= 1
    assert any("+0.01 in k3" in line for line in loose.advice)
    # a bound the lag-0 floor plus half a version allows: only designs with mean staleness <= 0.5
    tight = build(m, k3_bound=0.007)
    assert tight.recommended.design == SYNCHRONOUS
    assert any("Faster but left out" in line for line in tight.advice)


def test_whatif_command_prints_the_table_next_to_the_measured_run(tmp_path, capsys):
    write_run(tmp_path / "run.db")
    assert main(["whatif", str(tmp_path / "run.db")]) == 0
    out = capsys.readouterr().out
    for row in ("the run, measured", "synchronous", "one step ahead, drain", "async eta=8, partial",
                "async eta=8, drain", "Recommended:"):
        assert row in out
    assert main(["whatif", str(tmp_path / "run.db"), "--json", "--slots", "32"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pipeline"]["slots"] == 32 and len(doc["designs"]) == 9
    assert all(math.isfinite(row["episodes_per_hour"]) for row in doc["designs"])


def test_a_store_without_durations_is_refused_in_one_line(tmp_path, capsys):
    write_run(tmp_path / "run.db", durations=False)
    assert main(["whatif", str(tmp_path / "run.db")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "records no episode durations" in err
    write_run(tmp_path / "with.db")
    assert main(["whatif", str(tmp_path / "with.db"), "--env", "code"]) == 1
    assert "environments with durations: math" in capsys.readouterr().err
    assert main(["whatif", str(tmp_path / "with.db"), "--env", "math"]) == 0


def test_without_lag_the_recommendation_keeps_the_chapters_default_bound(tmp_path):
    write_run(tmp_path / "run.db", lag=False)
    result = build(load(str(tmp_path / "run.db")))
    assert result.recommended.design.eta <= 2
    assert "records no mismatch by version lag" in result.advice[0]


@pytest.mark.parametrize("flags, named", [
    (["--train-s", "nan"], "--train-s nan"), (["--sync-s", "1e308"], "--sync-s 1e+308"),
    (["--train-s", "-1"], "--train-s -1"), (["--batch-size", "1e9"], "--batch-size 1e+09"),
    (["--batch-size", "1000000000"], "--batch-size 1e+09"), (["--steps", "1e9"], "--steps 1e+09"),
    (["--slots", "0"], "--slots 0"), (["--steps", "2.5"], "--steps 2.5"), (["--k3-bound", "inf"], "--k3-bound inf"),
    (["--steps", "100000", "--batch-size", "1000"], "100,000 steps of 1,000 episodes"),
])
def test_absurd_flags_are_refused_in_one_line_with_status_2(tmp_path, capsys, flags, named):
    write_run(tmp_path / "run.db", steps=4)
    assert main(["whatif", str(tmp_path / "run.db"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("rlwatch whatif: ") and named in err


def test_the_pipeline_refuses_non_finite_seconds():
    for seconds in (math.nan, math.inf, 1e308 * 10):
        with pytest.raises(ValueError, match="finite"):
            Pipeline(train_s=seconds)
        with pytest.raises(ValueError, match="finite"):
            Pipeline(sync_s=seconds)


def test_the_runs_design_is_named_from_its_measured_lag_not_from_a_bound_it_exceeds(tmp_path, capsys):
    write_run(tmp_path / "run.db", lag_mean=7.64, lag_max=8.0)          # bound 2, a sampler 8 versions behind
    result = build(load(str(tmp_path / "run.db")))
    assert result.own == asynchronous(8, partial=True)
    assert "measured lag mean 7.64, max 8" in result.own_basis and "bound 2 does not hold" in result.own_basis
    assert main(["whatif", str(tmp_path / "run.db")]) == 0
    out = capsys.readouterr().out
    assert "own design: async eta=8, partial (from its measured lag mean 7.64" in out and "eta=2, partial (" not in out
    write_run(tmp_path / "held.db")                                     # lag mean 1.4 within the bound 2
    held = build(load(str(tmp_path / "held.db")))
    assert held.own == asynchronous(2, partial=True) and held.own_basis.startswith("its staleness bound 2")


def test_durations_of_a_toy_are_said_to_be_a_toys(tmp_path):
    write_run(tmp_path / "toy.db", scale=1e-4)              # the chapter's ~100 s episodes as ~10 ms
    toy = build(load(str(tmp_path / "toy.db")))
    assert any("a toy's durations" in note for note in toy.notes)
    write_run(tmp_path / "real.db")                          # ~10 s episodes
    assert not any("toy" in note for note in build(load(str(tmp_path / "real.db"))).notes)
