"""The verl integration against the real verl 0.9.1 package on CPU: ``Tracking.log`` mirrored and
checkpoints recorded, the headline signals joined to verl's metrics dict, what is never patched, install
and uninstall, version refusal and the options read from the environment."""

from __future__ import annotations

import copy
import logging
import os
import sqlite3
import sys
from types import SimpleNamespace

import pytest

from rlwatch import Watch

from ._verl_helpers import N, make_batch, separation_trainer


# --- Tracking.log, checkpoints, life cycle -------------------------------------------------------

def test_tracking_log_is_mirrored_and_checkpoints_recorded(config, instrumented, tmp_path):
    from prometheus_client import generate_latest

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.tracking import Tracking

    instr, watch = instrumented
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=[])
    tracking.log(data={"actor/grad_norm": 0.5, "critic/score/mean": 0.25, "table": "skipped"}, step=3)
    text = generate_latest(watch.registry).decode()
    series = f'rlwatch_framework_metric{{name="actor/grad_norm",run="verl-test",run_instance="{watch.run_instance}"}}'
    assert f"{series} 0.5" in text
    with pytest.raises(AssertionError):          # no rlwatch backend was added to verl's list
        Tracking(project_name="p", experiment_name="e", default_backend="rlwatch")

    cfg = copy.deepcopy(config)
    cfg.trainer.default_local_dir = str(tmp_path / "ckpt")
    trainer = object.__new__(RayPPOTrainer)
    trainer.config, trainer.global_steps, trainer.use_critic = cfg, 7, False
    trainer.actor_rollout_wg = SimpleNamespace(save_checkpoint=lambda path, *a, **k: os.makedirs(path))
    trainer.train_dataloader = SimpleNamespace(state_dict=lambda: {})
    trainer._save_checkpoint()

    class Overriding(RayPPOTrainer):                 # like FullyAsyncTrainer: its own _save_checkpoint
        def _save_checkpoint(self):
            root = self.config.trainer.default_local_dir
            os.makedirs(os.path.join(root, f"global_step_{self.current_param_version}"))

        def log(self):
            tracking.log(data={"x": 1.0}, step=self.global_steps)

    other = object.__new__(Overriding)
    other.config, other.global_steps, other.current_param_version, other.local_trigger_step = cfg, 12, 3, 1
    other.log()                                      # the first wrapper that meets it hooks the instance
    other._save_checkpoint()
    assert watch.flush()
    with sqlite3.connect(watch.store_path) as db:
        rows = db.execute("SELECT step, path FROM checkpoints ORDER BY step").fetchall()
        scalars = dict(db.execute("SELECT name, value FROM scalars WHERE step = 3").fetchall())
    assert rows == [(3, str(tmp_path / "ckpt" / "global_step_3")), (7, str(tmp_path / "ckpt" / "global_step_7"))]
    assert (tmp_path / "ckpt" / "global_step_7" / "data.pt").exists()
    assert scalars == {"actor/grad_norm": 0.5, "critic/score/mean": 0.25}


def test_headline_signals_join_verls_metrics_dict(config, instrumented, tmp_path, monkeypatch):
    """What verl logs to its trackers (here its own file backend) carries rlwatch/ headline keys."""
    import json

    from prometheus_client import generate_latest

    from verl.utils.tracking import Tracking

    instr, watch = instrumented
    trainer = separation_trainer(config, global_steps=5)
    trainer._fit_collect_metrics(make_batch(seed=1, versions=([3] * 8 + [2] * 8, [4] * 8 + [3] * 8)))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    tracking.log(data=dict(trainer.metrics), step=5)
    monkeypatch.setenv("RLWATCH_TRAINER_LOGS", "0")
    tracking.log(data=dict(trainer.metrics), step=6)
    first, off = [json.loads(line)["data"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    values = instr.last_values
    for key, name in (("kl_k3", "mismatch_kl_k3"), ("abs_log_ratio_p99", "mismatch_abs_log_ratio_p99"),
                      ("is_ess", "is_ess_ratio"), ("is_tis_truncated_frac", "is_tis_high_ratio"),
                      ("version_lag_max", "version_lag_max"),
                      ("version_lag_over_bound_frac", "version_lag_over_bound_ratio")):
        assert first[f"rlwatch/{key}"] == pytest.approx(values[name][()]), key
    assert first["rlwatch/version_lag_max"] == 2
    all_pass = values["zero_variance_groups_ratio"][("all_pass",)]
    assert first["rlwatch/zero_variance_all_pass_frac"] == pytest.approx(all_pass)
    assert {k: v for k, v in first.items() if not k.startswith("rlwatch/")} == off     # verl's own keys unchanged
    assert not any(k.startswith("rlwatch/") for k in off)                              # RLWATCH_TRAINER_LOGS=0
    assert 'name="rlwatch/kl_k3"' not in generate_latest(watch.registry).decode()      # not stored back


def test_fully_async_actor_class_is_never_patched_and_wrappers_pickle(config):
    import cloudpickle

    import verl.experimental.fully_async_policy.fully_async_trainer as fully_async
    import verl.trainer.ppo.metric_utils as metric_utils
    from rlwatch.integrations import verl as rv

    actor_class = fully_async.FullyAsyncTrainer
    inner = actor_class.__ray_metadata__.modified_class
    before = dict(vars(inner.__mro__[1]))
    assert rv.instrument(watch=Watch(port=None, store=None))
    try:
        assert dict(vars(inner.__mro__[1])) == before
        # Ray pickles actor classes by value; a wrapper that ends up in one must pickle too.
        wrapper = metric_utils.compute_data_metrics
        by_value = type(wrapper)(wrapper.__code__, wrapper.__globals__, "w", None, wrapper.__closure__)
        by_value.__module__, by_value.__qualname__ = "__main__", "nowhere"
        restored = cloudpickle.loads(cloudpickle.dumps(by_value))
        assert restored.__closure__ is not None
    finally:
        rv.uninstrument()


def test_idempotent_and_uninstrument_restores_originals(config, caplog):
    import verl.trainer.ppo.metric_utils as metric_utils
    import verl.trainer.ppo.v1.trainer_base as v1
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.tracking import Tracking
    from rlwatch.integrations import verl as rv

    originals = (metric_utils.compute_data_metrics, Tracking.log, v1.PPOTrainer._compute_metrics,
                 v1.PPOTrainer._save_checkpoint, RayPPOTrainer._save_checkpoint)
    meta_path = list(sys.meta_path)
    assert rv.instrument(watch=Watch(port=None, store=None))
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        assert not rv.instrument()
    assert sum("already instrumented" in r.message for r in caplog.records) == 1
    assert Tracking.log.__rlwatch_original__ is originals[1]
    rv.uninstrument()
    rv.uninstrument()                                   # a second call is a no-op
    assert (metric_utils.compute_data_metrics, Tracking.log, v1.PPOTrainer._compute_metrics,
            v1.PPOTrainer._save_checkpoint, RayPPOTrainer._save_checkpoint) == originals
    assert sys.meta_path == meta_path and rv.INSTRUMENTOR.watch is None


@pytest.mark.parametrize("version", ["0.8.5", "0.10.0"])
def test_other_verl_versions_are_refused_with_one_warning(config, monkeypatch, caplog, version):
    import verl.trainer.ppo.metric_utils as metric_utils
    from rlwatch.integrations import _instrumentor
    from rlwatch.integrations import verl as rv

    monkeypatch.setattr(_instrumentor, "installed_version", lambda package: version)
    original = metric_utils.compute_data_metrics
    meta_path = list(sys.meta_path)
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        assert not rv.instrument()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and version in warnings[0].message and ">=0.9,<0.10" in warnings[0].message
    assert metric_utils.compute_data_metrics is original and sys.meta_path == meta_path
    assert not rv.INSTRUMENTOR.is_instrumented


def test_watch_options_from_env(config):
    from rlwatch.integrations.verl import watch_options_from_env

    opts = watch_options_from_env({"RLWATCH_PORT": "0", "RLWATCH_STORE": "none", "RLWATCH_SD_DIR": "/sd",
                                   "RLWATCH_STALENESS_BOUND": "2"}, config)
    assert opts["run"] == "verl-test" and opts["port"] == 0 and opts["store"] is None
    assert opts["sd_dir"] == "/sd" and opts["staleness_bound"] == 2.0 and opts["group_size"] == N
    assert opts["framework"] == "verl" and opts["framework_version"].startswith("0.9")
    opts = watch_options_from_env({"RLWATCH_RUN": "r", "RLWATCH_PORT": "none", "RLWATCH_GROUP_SIZE": "0"}, None)
    assert opts["run"] == "r" and opts["port"] is None and "group_size" not in opts
