"""The trainer's dynamics from the real frameworks with no code change: a real TRL GRPOTrainer's logs and
verl's own metric functions and ``Tracking.log`` become rlwatch's dynamics signals in the step rows, and
every recognised TRL and verl name is the installed package's own key."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sqlite3

import pytest

from rlwatch.core.trainer_keys import TRAINER_KEYS, recognise
from rlwatch.runs.store import StoreReader

from .conftest import need_module

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def package_source(*modules: str) -> str:
    """The text of the installed packages' Python files (to find a key built outside a test's reach)."""
    text = []
    for module in modules:
        root = pathlib.Path(importlib.util.find_spec(module).origin).parent
        text += [p.read_text(errors="replace") for p in root.rglob("*.py")]
    return "\n".join(text)


def test_trl_logs_become_the_steps_dynamics(model_path, tmp_path):
    need_module("trl")
    from rlwatch.integrations import trl as rltrl

    from ._trl_tiny import make_trainer

    store = str(tmp_path / "run.db")
    trainer = make_trainer(model_path, tmp_path / "out", max_steps=3)
    watch = rltrl.watch(trainer, run="trl-dyn", port=None, store=store)
    trainer.train()
    assert watch.flush()
    logs = {h["step"]: h for h in trainer.state.log_history if "grad_norm" in h}
    with StoreReader(store) as reader:
        rows = {row.step: row for row in reader.steps("trl-dyn")}
    assert sorted(logs) == [1, 2, 3] and sorted(rows) == [1, 2, 3]
    for step, logged in logs.items():
        assert rows[step].get("grad_norm") == pytest.approx(logged["grad_norm"])
        assert rows[step].get("learning_rate") == pytest.approx(logged["learning_rate"])
        assert rows[step].get("clip_fraction") == pytest.approx(logged["clip_ratio/region_mean"])
        assert rows[step].get("loss") == pytest.approx(logged["loss"])
        assert rows[step].get("tokens")                               # observe's values kept
        assert rows[step].get("sequences") == 8.0
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM step_history").fetchone() == (0,)     # one row per step
    rltrl.unwatch(trainer)
    watch.close()
    # Every TRL name of the table is one TRL (or transformers' Trainer) logs.
    logged = set().union(*(h.keys() for h in trainer.state.log_history))
    source = package_source("trl", "transformers")
    for entry in (e for e in TRAINER_KEYS if e.framework == "TRL"):
        assert entry.key in logged or f'"{entry.key}"' in source or f'"{entry.key[5:]}' in source, entry
        if entry.key in logged:
            assert entry.signal in recognise({entry.key: 1.0})


def test_verl_metrics_through_tracking_log_become_the_steps_dynamics(config, instrumented):
    need_module("verl")
    import verl.trainer.ppo.metric_utils as metric_utils
    from verl.utils.tracking import Tracking

    from ._verl_helpers import make_batch, separation_trainer

    instr, watch = instrumented
    batch = make_batch(seed=1, versions=([3] * 8 + [2] * 8, [4] * 8 + [3] * 8))
    metrics = metric_utils.compute_data_metrics.__rlwatch_original__(batch=copy.deepcopy(batch), use_critic=False)
    trainer = separation_trainer(config, global_steps=5)
    trainer._fit_collect_metrics(batch)                 # observe(5) through the integration
    logged = {**metrics, "actor/ppo_kl": 0.02, "actor/grad_norm": 0.7, "actor/pg_clipfrac": 0.1, "actor/lr": 1e-6}
    Tracking(project_name="p", experiment_name="e", default_backend=[]).log(data=logged, step=5)
    assert watch.flush()
    with StoreReader(watch.store_path) as reader:
        (row,) = reader.steps("verl-test")
    assert row.step == 5
    assert row.get("policy_kl") == 0.02 and row.get("grad_norm") == 0.7 and row.get("learning_rate") == 1e-6
    assert row.get("version_lag_max") == 2                          # observe's own values are still there
    assert row.get("reward_mean") == pytest.approx(instr.last_values["reward_mean"][()])   # rlwatch's own wins
    assert set(recognise(metrics)) >= {"reward_mean", "response_length_mean", "truncated_ratio"}
    source = package_source("verl")
    for entry in (e for e in TRAINER_KEYS if e.framework == "verl" and e.key):
        short = entry.key.split("/", 1)[1]
        assert f'"{entry.key}"' in source or f'"{short}"' in source or entry.key in metrics, entry


def test_trl_trained_twice_on_a_batch_gives_rlwatchs_own_policy_kl(model_path, tmp_path):
    """GRPOTrainer with num_iterations=2: each batch is trained on twice, TRL keeps the generating
    policy's log-probs (old_per_token_logps), and rlwatch computes the policy KL of the current policy
    against them: 0 on a batch's first pass (no update yet), above 0 on its second (one update since)."""
    need_module("trl")
    from rlwatch.integrations import trl as rltrl

    from ._trl_tiny import make_trainer

    store = str(tmp_path / "run.db")
    trainer = make_trainer(model_path, tmp_path / "out", max_steps=4, num_iterations=2)
    watch = rltrl.watch(trainer, run="trl-pkl", port=None, store=store)
    trainer.train()
    assert watch.flush()
    rltrl.unwatch(trainer)
    watch.close()
    with StoreReader(store) as reader:
        kl = {row.step: row.get("policy_kl") for row in reader.steps("trl-pkl")}
    assert sorted(kl) == [1, 2, 3, 4] and None not in kl.values(), kl
    assert abs(kl[1]) < 1e-6 and abs(kl[3]) < 1e-6, kl           # first pass: the generating policy itself
    assert kl[2] > 1e-6 and kl[4] > 1e-6, kl                     # second pass: one update later
