"""``rlwatch replay`` reads each format from a file the real package wrote (TRL's Trainer, verl's
loggers, torch's SummaryWriter read back by TensorBoard) or in its documented layout (W&B's CSV
export), and a collapsed run in each format is replayed to the collapse it holds."""

from __future__ import annotations

import pytest

from rlwatch.replay import load, load_all, replay

from ._replay_helpers import (DROP, STEPS, collapsed_rows, finite, write_tensorboard_csvs, write_trl,
                              write_verl_console, write_verl_jsonl, write_wandb_csv)
from .conftest import need_module


@pytest.mark.slow
def test_trl_trainer_state_written_by_the_real_trainer(tmp_path):
    """TRL's GRPOTrainer on a tiny model, 4 steps logged every step, checkpoints every 2: replay reads
    the last checkpoint's trainer_state.json (given the output directory) row for row."""
    need_module("trl")
    from ._trl_tiny import build_tiny_model, make_trainer

    trainer = make_trainer(build_tiny_model(tmp_path), tmp_path / "out", max_steps=4, save_strategy="steps",
                           save_steps=2)
    trainer.train()
    run = load(tmp_path / "out")
    assert run.fmt == "trl" and run.source.endswith("checkpoint-4/trainer_state.json")
    logged = [e for e in trainer.state.log_history if "train_runtime" not in e]
    assert run.steps == [e["step"] for e in logged] == [1, 2, 3, 4]
    for row, entry in zip(run.rows, logged):
        expected = finite({k: v for k, v in entry.items() if k != "step"})
        assert row == pytest.approx(expected)
    assert run.reward_key == "reward" and run.log_every == 1
    result = replay(run, store_dir=tmp_path / "stores")
    assert result.postmortem["quality_signal"] == "reward"
    assert result.postmortem["steps"] == [1, 4]


def _verl(tmp_path, writer, rows):
    need_module("verl")
    return writer(tmp_path / "verl.log", rows)


WRITERS = {
    "trl": lambda tmp, rows: write_trl(tmp / "trainer_state.json", rows),
    "verl-console-ray": lambda tmp, rows: _verl(tmp, lambda p, r: write_verl_console(p, r, "(TaskRunner pid=4242) "),
                                                rows),
    "verl-console": lambda tmp, rows: _verl(tmp, write_verl_console, rows),
    "verl-jsonl": lambda tmp, rows: _verl(tmp, write_verl_jsonl, rows),
    "csv": lambda tmp, rows: write_wandb_csv(tmp / "wandb_export.csv", rows),
}
REWARD = {"trl": "reward", "verl-console": "critic/score/mean", "verl-console-ray": "critic/score/mean",
          "verl-jsonl": "critic/score/mean", "csv": "reward"}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_each_format_parses_to_the_logged_rows(tmp_path, fmt):
    if fmt.startswith("verl"):
        need_module("verl")
    rows = collapsed_rows(REWARD[fmt])
    run = load(WRITERS[fmt](tmp_path, rows))
    assert run.fmt == fmt.removesuffix("-ray")
    assert run.steps == [s for s, _ in rows]
    logged = [{k: v for k, v in row.items() if k != "epoch"} for row in run.rows]      # TRL logs the epoch too
    assert logged == [pytest.approx(values) for _, values in rows]
    assert run.reward_key == REWARD[fmt]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_a_collapsed_run_in_each_format_names_the_collapse(tmp_path, fmt):
    if fmt.startswith("verl"):
        need_module("verl")
    run = load(WRITERS[fmt](tmp_path, collapsed_rows(REWARD[fmt])))
    result = replay(run, store_dir=tmp_path / "stores")
    assert result.collapse_step == DROP
    assert result.postmortem["collapse_step"] == DROP
    assert result.postmortem["peak"]["value"] == pytest.approx(0.8)


def test_a_healthy_run_has_no_collapse(tmp_path):
    rows = [(s, {**v, "reward": 0.1 + 0.7 * min(s, 30) / 30}) for s, v in collapsed_rows()]
    result = replay(load(write_trl(tmp_path / "trainer_state.json", rows)), store_dir=tmp_path)
    assert result.collapse_step is None and result.first_page_step is None


def test_tensorboard_tag_exports_are_one_run(tmp_path):
    """Every tag of a SummaryWriter log exported as TensorBoard's CSV (as OpenRLHF's TensorBoard logger
    names them): one run, its keys from the file names, the collapse named."""
    need_module("tensorboard")
    files = write_tensorboard_csvs(tmp_path, collapsed_rows())
    runs = load_all([str(p) for p in files])
    assert len(runs) == 1
    (run,) = runs
    assert run.fmt == "tensorboard-csv" and set(run.keys) == {"train_reward", "train_entropy", "train_loss"}
    assert run.steps == list(range(1, STEPS + 1))
    result = replay(load_all([str(p) for p in files], reward_key="train_reward")[0], store_dir=tmp_path / "s")
    assert result.collapse_step == DROP


def test_a_log_written_every_k_steps_keeps_its_step_numbers(tmp_path):
    need_module("verl")
    rows = collapsed_rows("critic/score/mean", steps=200, every=5)
    run = load(write_verl_console(tmp_path / "verl.log", rows))
    assert run.log_every == 5 and run.steps[:3] == [5, 10, 15]
    result = replay(run, store_dir=tmp_path)
    assert result.collapse_step == DROP
    assert "logged every 5 steps" in result.as_json()["replay"]["treatment"]


def test_nan_values_are_counted_not_replayed(tmp_path):
    need_module("verl")
    rows = collapsed_rows("critic/score/mean")
    rows[10][1]["loss"] = float("nan")
    for writer in (write_verl_console, write_verl_jsonl):
        run = load(writer(tmp_path / f"{writer.__name__}.log", rows))
        assert run.nonfinite == {"loss": [11]} and "loss" not in run.rows[10]


def test_the_alerts_the_logged_values_trip_are_replayed(tmp_path):
    """A run whose logged entropy falls to a tenth at step 30, ten steps before its reward collapses:
    the entropy alert fires from the logged values alone, before the collapse, in the result, the
    JSON and the table; the same run with the entropy steady does not raise it."""
    from rlwatch.replay import report

    rows = [(s, {**v, "entropy": 1.0 if s < 30 else 0.1}) for s, v in collapsed_rows()]
    result = replay(load(write_trl(tmp_path / "trainer_state.json", rows)), store_dir=tmp_path / "a")
    entropy = [a for a in result.alerts if a.name == "RLWatchEntropyCollapse" and a.state == "fired"]
    assert len(entropy) == 1 and entropy[0].severity == "warning" and 30 <= entropy[0].step < DROP
    assert result.first_warning_step == entropy[0].step and result.collapse_step == DROP
    assert result.as_json()["replay"]["first_warning_step"] == result.first_warning_step
    assert f"RLWatchEntropyCollapse fired at {entropy[0].step}" in report.text(result)
    steady = replay(load(write_trl(tmp_path / "steady.json", collapsed_rows())), store_dir=tmp_path / "b")
    assert "RLWatchEntropyCollapse" not in {a.name for a in steady.alerts}


def _verl_precursor_rows(moving: bool) -> list[tuple[int, dict]]:
    """verl's names: the score collapsing at DROP; from step 30 the entropy doubling and the policy KL
    rising thirtyfold, past the 0.1 nats ``policy_kl_floor`` (``moving``), or both steady."""
    out = []
    for step, values in collapsed_rows("critic/score/mean"):
        late = moving and step >= 30
        out.append((step, {"critic/score/mean": values["critic/score/mean"], "actor/entropy": 1.2 if late else 0.6,
                           "actor/ppo_kl": 0.15 if late else 0.005, "actor/pg_loss": values["loss"]}))
    return out


def test_precursors_in_a_verl_log_page_before_the_collapse(tmp_path):
    """verl's console log, its own names: the entropy surge and the policy-KL departure together page
    (RLWatchCollapsePrecursors) before the score collapses, marked PAGE in the table; with the two
    steady, the same collapse is not paged before it."""
    from rlwatch.replay import report

    need_module("verl")
    result = replay(load(write_verl_console(tmp_path / "moving.log", _verl_precursor_rows(True))), store_dir=tmp_path)
    pages = [a for a in result.alerts if a.severity == "critical" and a.state == "fired"]
    assert pages and pages[0].name == "RLWatchCollapsePrecursors"
    assert 30 <= result.first_page_step == pages[0].step < DROP == result.collapse_step
    assert {"RLWatchEntropySurge", "RLWatchPolicyKLDeparture"} <= {a.name for a in result.alerts}
    assert f"PAGE RLWatchCollapsePrecursors fired at {pages[0].step}" in report.text(result)
    assert f"({DROP - pages[0].step} steps before the collapse)" in report.text(result)
    steady = replay(load(write_verl_console(tmp_path / "steady.log", _verl_precursor_rows(False))),
                    store_dir=tmp_path)
    assert steady.collapse_step == DROP
    assert steady.first_page_step is None or steady.first_page_step >= DROP


def test_mismatch_aggregates_map_where_the_definition_is_rlwatchs(tmp_path):
    """verl's rollout_corr/k3_kl is rlwatch's k3 and is read as it; its other mismatch aggregates are
    kept under their own names and listed as such."""
    need_module("verl")
    rows = [(s, {**v, "rollout_corr/k3_kl": 0.001, "training/rollout_probs_diff_mean": 0.01,
                 "actor/ppo_kl": 0.002}) for s, v in collapsed_rows("critic/score/mean")]
    run = load(write_verl_console(tmp_path / "verl.log", rows))
    assert run.recognised()["rollout_corr/k3_kl"] == "mismatch_kl_k3"
    assert run.recognised()["actor/ppo_kl"] == "policy_kl"
    assert run.kept_mismatch_aggregates() == ["training/rollout_probs_diff_mean"]
    result = replay(run, store_dir=tmp_path)
    assert result.as_json()["replay"]["kept_mismatch_aggregates"] == ["training/rollout_probs_diff_mean"]


def test_wandb_chart_exports_of_one_run_are_one_run(tmp_path):
    """W&B's ``Download CSV`` on one panel at a time (the run's reward chart, its entropy chart, its loss
    chart): the files given together are one run; another run's charts, or a second export of keys already
    read (a run of the same name elsewhere), stay runs of their own."""
    rows = collapsed_rows()
    charts = [write_wandb_csv(tmp_path / f"chart_{key}.csv", [(s, {key: v[key]}) for s, v in rows])
              for key in ("reward", "entropy", "loss")]
    other = write_wandb_csv(tmp_path / "other.csv", [(s, {"reward": v["reward"]}) for s, v in rows], run="ppo-7b")
    again = write_wandb_csv(tmp_path / "again.csv", [(s, {"reward": v["reward"]}) for s, v in rows])
    runs = load_all([str(p) for p in (*charts, other, again)])
    assert len(runs) == 3
    merged = runs[0]
    assert merged.fmt == "csv" and set(merged.keys) == {"reward", "entropy", "loss"}
    assert "3 W&B chart exports of grpo-qwen-0.5b" in merged.source
    assert set(runs[1].keys) == {"reward"} and set(runs[2].keys) == {"reward"}
    assert replay(merged, store_dir=tmp_path / "s").collapse_step == DROP
    assert len(load_all([str(charts[0])])) == 1 and load_all([str(charts[0])])[0].source == str(charts[0])
