"""A framework release that renamed or removed a method an integration patches, met at attach time with
the real TRL and verl packages: one warning line naming what is missing, nothing patched, and the run
goes on unwatched rather than half-watched (OpenRLHF: tests/test_openrlhf_lifecycle.py)."""

from __future__ import annotations

import logging
import sys
from types import ModuleType

import pytest

from rlwatch import Watch

from .conftest import need_module

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_trl_trainer_without_a_patched_method_is_left_unwatched(model_path, tmp_path, monkeypatch, caplog):
    need_module("trl")
    from rlwatch.integrations import trl as rltrl

    from ._trl_tiny import make_trainer

    trainer = make_trainer(model_path, tmp_path / "out", max_steps=1)
    owner = next(c for c in type(trainer).__mro__ if "_compute_loss" in vars(c))
    monkeypatch.delattr(owner, "_compute_loss")          # as if a release renamed it
    callbacks_before = list(trainer.callback_handler.callbacks)
    caplog.set_level(logging.WARNING, logger="rlwatch")
    watch = rltrl.watch(trainer, run="trl-renamed", port=None, store=None)
    try:
        warnings = _warnings(caplog)
        assert len(warnings) == 1, warnings
        assert f"has no {type(trainer).__name__}._compute_loss" in warnings[0] and "unwatched" in warnings[0]
        patched = [name for name in ("_calculate_rewards", "_generate_and_score_completions",
                                     "_get_per_token_logps_and_entropies", "training_step") if name in vars(trainer)]
        assert patched == [] and trainer.callback_handler.callbacks == callbacks_before
    finally:
        watch.close()


def test_verl_module_without_a_patched_method_refuses_before_patching(config, monkeypatch, caplog):
    import verl.trainer.ppo.metric_utils as metric_utils
    from verl.utils.tracking import Tracking

    from rlwatch.integrations import verl as rv

    monkeypatch.delattr(Tracking, "log")                  # verl.utils.tracking is imported: checked at once
    original, meta_path = metric_utils.compute_data_metrics, list(sys.meta_path)
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        assert not rv.instrument(watch=Watch(port=None, store=None))
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "has no verl.utils.tracking.Tracking.log" in warnings[0], warnings
    assert metric_utils.compute_data_metrics is original and sys.meta_path == meta_path
    assert not rv.INSTRUMENTOR.is_instrumented


def test_verl_module_imported_later_without_a_class_turns_the_whole_integration_off(config, caplog):
    """A module the table names, imported after instrument() (Ray workers import verl lazily), that lacks
    a class: the patches already made are undone, so no step is observed by half the hooks."""
    import verl.trainer.ppo.metric_utils as metric_utils

    from rlwatch.integrations import verl as rv

    original = metric_utils.compute_data_metrics
    assert rv.instrument(watch=Watch(port=None, store=None))
    try:
        assert metric_utils.compute_data_metrics.__rlwatch_original__ is original
        renamed = ModuleType("verl.trainer.ppo.ray_trainer")   # a copy whose trainer class was renamed
        renamed.RayPPOTrainerV2 = type("RayPPOTrainerV2", (), {"_save_checkpoint": lambda self: None})
        with caplog.at_level(logging.WARNING, logger="rlwatch"):
            rv.INSTRUMENTOR._on_import(renamed)
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and "has no verl.trainer.ppo.ray_trainer.RayPPOTrainer._save_checkpoint" \
            in warnings[0], warnings
        assert not rv.INSTRUMENTOR.is_instrumented and metric_utils.compute_data_metrics is original
    finally:
        rv.uninstrument()
