"""TRL integration, a real GRPOTrainer on CPU with a tiny offline model: attaching through a user's
callback, TRL's own phase timings, guards, watch/unwatch and version refusal, errors kept from the trainer,
the pure helpers, and the post-mortem on a TRL output directory."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import rlwatch
from rlwatch.runs.store import StoreReader

from .conftest import need_module

need_module("trl")

from rlwatch.integrations import trl as rltrl  # noqa: E402

from ._trl_tiny import EOS, PAD, make_trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_split_generation_batch_through_the_callback(model_path, tmp_path):
    """A user-made Watch passed as callbacks=[RLWatchCallback(watch)] attaches at train begin.
    steps_per_generation=2 > gradient_accumulation_steps=1: the second half of each generation batch
    is trained one update later (lag 1); the group signals still come from the whole batch, once."""
    store = str(tmp_path / "run.db")
    watch = rlwatch.Watch(run="trl-split", port=None, store=store, framework="trl")
    callback = rltrl.RLWatchCallback(watch)
    trainer = make_trainer(model_path, tmp_path / "out", callbacks=[callback], steps_per_generation=2, max_steps=2)
    trainer.train()
    watch.flush()
    with StoreReader(store) as reader:
        rows = reader.steps("trl-split")
    assert [r.step for r in rows] == [1, 2]
    assert [r.get("version_lag_max") for r in rows] == [0.0, 1.0]
    assert [r.get("sequences") for r in rows] == [8.0, 8.0]
    assert [r.get("groups") for r in rows] == [4.0, 4.0] and [r.get("groups_total") for r in rows] == [4.0, None]
    assert [r.get("generation") for r in rows] == [1.0, 1.0]
    assert callback.trainer is trainer and rltrl.watch(trainer) is watch    # attached through the stack
    rltrl.unwatch(trainer)
    assert callback in trainer.callback_handler.callbacks                   # the user's callback stays
    assert not watch._closed                                                # and so does the user's Watch
    watch.close()


@pytest.mark.slow
def test_phases_come_from_trls_own_timing_points(model_path, tmp_path):
    """The training phase is TRL's ``training_step`` time (the sum TRL logs as ``step_time``), the
    generation phase its ``profiling_context`` generate block, on the step that generated (TRL 1.16
    generates once per generation batch); stored and exported per step, and restored on unwatch."""
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.profiling_context
    store = str(tmp_path / "run.db")
    trainer = make_trainer(model_path, tmp_path / "out", steps_per_generation=2, max_steps=2)
    watch = rltrl.watch(trainer, run="trl-phases", port=None, store=store)
    assert grpo_module.profiling_context is not original
    trainer.train()
    watch.flush()
    with StoreReader(store) as reader:
        rows = {row.step: row for row in reader.steps("trl-phases")}
    logs = {h["step"]: h for h in trainer.state.log_history if "step_time" in h}
    for step in (1, 2):
        assert rows[step].get("phase_seconds", ("training",)) == pytest.approx(logs[step]["step_time"], abs=0.05)
        assert rows[step].get("phase_seconds_total", ("training",)) == rows[step].get("phase_seconds", ("training",))
    assert rows[1].get("phase_seconds", ("generation",)) > 0                  # generated at step 1 only
    assert rows[2].get("phase_seconds", ("generation",)) is None
    assert rows[1].get("weight_sync_seconds") is None                        # no vLLM: nothing to sync
    rltrl.unwatch(trainer)
    assert grpo_module.profiling_context is original

    # The vLLM path (rollout_func, TRL's sync_weights block around a stand-in engine's sync).
    trainer = make_trainer(model_path, tmp_path / "out-vllm", rollout=True, max_steps=1)
    slow_sync = trainer.vllm_generation.sync_weights = lambda: time.sleep(0.05)
    watch = rltrl.watch(trainer, run="trl-sync", port=None, store=store)
    trainer.train()
    watch.flush()
    with StoreReader(store) as reader:
        row = reader.steps("trl-sync")[0]
    assert slow_sync and 0.05 <= row.get("weight_sync_seconds") == row.get("phase_seconds", ("sync",)) < 1.0
    rltrl.unwatch(trainer)


def test_guard_stops_training_and_saves(model_path, tmp_path):
    """Guards stop_on_critical and save_on_critical: the critical KL spike of the made-up sampler
    log-probs (critical once it holds 2 consecutive steps, the paging policy) stops a 6-step run at
    step 2, with a checkpoint."""
    store = str(tmp_path / "run.db")
    trainer = make_trainer(model_path, tmp_path / "out", rollout=True, max_steps=6)
    watch = rltrl.watch(trainer, run="trl-guard", port=None, store=store,
                        guard=(rltrl.stop_on_critical, rltrl.save_on_critical))
    trainer.train()
    watch.flush()
    assert trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").exists()
    with StoreReader(store) as reader:
        assert [r.step for r in reader.steps("trl-guard")] == [1, 2]
        fired = [a for a in reader.alerts("trl-guard") if a["state"] == "firing" and a["severity"] == "critical"]
        assert "RLWatchKLSpike" in [a["name"] for a in fired] and all(a["step"] == 2 for a in fired)
        assert reader.checkpoints("trl-guard") == [(2, str(tmp_path / "out" / "checkpoint-2"))]
    rltrl.unwatch(trainer)


def test_idempotent_and_unwatch_restores(model_path, tmp_path, caplog):
    trainer = make_trainer(model_path, tmp_path / "out", max_steps=1)
    names = ("_calculate_rewards", "_generate_and_score_completions", "_compute_loss",
             "_get_per_token_logps_and_entropies")
    before = {name: getattr(trainer, name) for name in names}
    callbacks_before = list(trainer.callback_handler.callbacks)
    watch = rltrl.watch(trainer, run="trl-idem", port=0, store=None)
    assert all(name in vars(trainer) for name in names)
    caplog.set_level(logging.WARNING, logger="rlwatch")
    assert rltrl.watch(trainer, run="other") is watch
    assert "already watched" in caplog.text
    assert sum(isinstance(c, rltrl.RLWatchCallback) for c in trainer.callback_handler.callbacks) == 1
    rltrl.unwatch(trainer)
    assert not any(name in vars(trainer) for name in names)
    assert {name: getattr(trainer, name) for name in names} == before
    assert trainer.callback_handler.callbacks == callbacks_before
    assert watch.url is not None and watch._closed
    rltrl.unwatch(trainer)                                               # a second unwatch is a no-op


def test_unsupported_version_refuses_and_patches_nothing(model_path, tmp_path, monkeypatch, caplog):
    from rlwatch.integrations import _instrumentor

    monkeypatch.setattr(_instrumentor, "installed_version", lambda package: "1.17.0")
    trainer = make_trainer(model_path, tmp_path / "out", max_steps=1)
    callbacks_before = list(trainer.callback_handler.callbacks)
    caplog.set_level(logging.WARNING, logger="rlwatch")
    watch = rltrl.watch(trainer, run="trl-old", port=None, store=None)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "supports trl >=1.15,<1.17, found 1.17.0" in warnings[0].getMessage()
    assert not any(name.startswith("_") and callable(v) for name, v in vars(trainer).items()
                   if name in ("_calculate_rewards", "_generate_and_score_completions", "_compute_loss",
                               "_get_per_token_logps_and_entropies"))
    assert trainer.callback_handler.callbacks == callbacks_before
    assert watch.metadata["framework_version"] == "1.17.0"
    watch.close()


def test_hook_errors_never_reach_the_trainer(model_path, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("rlwatch bug")

    # A failure while assembling the step (on rlwatch's thread) and one while capturing (on the
    # training thread): both counted, the training unharmed.
    for patched, kind in (("step_fields", "trl_observe"), ("_on_loss", "trl_loss")):
        with monkeypatch.context() as patch:
            patch.setattr(rltrl.GRPOInstrumentor, patched, boom)
            trainer = make_trainer(model_path, tmp_path / patched, max_steps=2)
            watch = rltrl.watch(trainer, run="trl-errors", port=None, store=None, background=True)
            trainer.train()
            assert trainer.state.global_step == 2
            assert watch.errors.snapshot()[("integration", kind)] == 2
            rltrl.unwatch(trainer)

    # strict=True is for tests: there the error does reach the caller.
    monkeypatch.setattr(rltrl.GRPOInstrumentor, "_on_generation", boom)
    trainer = make_trainer(model_path, tmp_path / "strict", max_steps=1)
    rltrl.watch(trainer, run="trl-strict", port=None, store=None, strict=True)
    with pytest.raises(RuntimeError, match="rlwatch bug"):
        trainer.train()
    rltrl.unwatch(trainer)


def test_pure_helpers():
    from types import SimpleNamespace

    # Truncated = the unpadded completion does not end on EOS/pad (never judged by the padded width).
    flags = rltrl.truncation_flags([[5, 6, EOS], [5, 6, 7, 8], [5, PAD], []], {EOS, PAD})
    assert flags.tolist() == [False, True, False, False]
    assert rltrl.env_labels([{"prompt": "a", "data_source": "gsm8k"}]) == ["gsm8k"]
    assert rltrl.env_labels([{"prompt": "a", "environment": 3, "env": "x"}]) == ["3"]
    assert rltrl.env_labels([{"prompt": "a"}]) is None

    trainer = SimpleNamespace(train_dataset=SimpleNamespace(column_names=["prompt", "data_source"]))
    assert rltrl.env_labels_present(trainer)
    trainer.train_dataset.column_names = ["prompt"]
    assert not rltrl.env_labels_present(trainer)
    from rlwatch.integrations._tensors import pad_cat

    padded = pad_cat([torch.ones(2, 3), torch.ones(1, 5)], 5)
    assert padded.shape == (3, 5) and padded[:2, 3:].eq(0).all() and padded[2].eq(1).all()


def test_postmortem_and_probe_on_a_trl_output_directory(model_path, tmp_path):
    """`rlwatch postmortem OUT --probe` on what a real TRL run left: the store the one-line hook
    wrote next to the checkpoints, TRL's log history, the checkpoint directories, and the fixed
    rollouts the hook kept; every checkpoint is scored on them (safetensors, nothing unpickled)."""
    import json
    import subprocess
    import sys

    from rlwatch.postmortem.probe import ROLLOUTS_FILE, load_rollouts

    out = tmp_path / "out"
    trainer = make_trainer(model_path, out, max_steps=3, save_strategy="steps", save_steps=1, learning_rate=5e-2)
    watch = rltrl.watch(trainer, port=None)
    trainer.train()
    rltrl.unwatch(trainer)
    assert watch.errors.total() == 0, watch.errors.snapshot()
    rollouts = load_rollouts(out / ROLLOUTS_FILE)
    assert rollouts["input_ids"].shape[0] == 8 and int(rollouts["response_mask"].sum()) > 0
    assert torch.equal(rollouts["response_mask"] * rollouts["attention_mask"], rollouts["response_mask"])

    result = subprocess.run([sys.executable, "-m", "rlwatch.ops.cli", "postmortem", str(out), "--json", "--probe"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["source"].startswith(f"TRL {out}") and "store" in doc["source"]
    assert doc["steps"] == [1, 3]
    probe = doc["probe"]
    assert [(r["step"], r["path"]) for r in probe] == [(s, str(out / f"checkpoint-{s}")) for s in (1, 2, 3)]
    assert all(r["error"] is None and r["mean_logp"] < 0 for r in probe)
    assert probe[0]["kl_to_next"] > 0 and probe[1]["kl_to_next"] > 0 and probe[2]["kl_to_next"] is None

    # The report a person reads shows the same, in the terminal and in markdown.
    result = subprocess.run([sys.executable, "-m", "rlwatch.ops.cli", "postmortem", str(out), "--probe",
                             str(out / ROLLOUTS_FILE), "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Checkpoint probe" in result.stdout and f"{probe[0]['kl_to_next']:.4g}" in result.stdout
    markdown = (tmp_path / "report" / "postmortem.md").read_text()
    assert "## Checkpoint probe" in markdown and f"`{out / 'checkpoint-1'}`" in markdown
