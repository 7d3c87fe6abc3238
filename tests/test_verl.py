"""The verl integration against the real verl 0.9.1 package on CPU.

Batches are built with verl's own DataProto, as its trainers build them (prompt batch with one
``uid`` per prompt repeated ``rollout.n`` times, unioned with the rollout output), advantages come
from verl's ``compute_advantage``, and the config is verl's ``ppo_trainer.yaml`` composed by Hydra.
The v1 path runs against a real TransferQueue, and the delivery into Ray workers uses a real
local Ray instance started with the runtime_env that verl's ``main_ppo.run_ppo`` builds from the
documented override.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import sqlite3
import sys
import urllib.request
import uuid
from types import SimpleNamespace

import pytest
import torch

from rlwatch import SignalConfig, Watch, compute

from tests.conftest import ROOT, need_module

HOOK = "rlwatch.integrations.verl.setup_hook"
N = 4                      # rollout.n
MAX_PROMPT, MAX_RESPONSE = 8, 16
TIMING_KEYS = {"hook_compute_seconds", "hook_compute_seconds_total", "last_step_timestamp_seconds",
               "step_interval_seconds"}


# --- helpers -------------------------------------------------------------------------------------

def compose_config(*overrides: str):
    """verl's ppo_trainer.yaml composed with Hydra, as ``main_ppo`` does."""
    from hydra import compose, initialize_config_dir

    import verl.trainer.main_ppo as main_ppo

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"data.max_prompt_length={MAX_PROMPT}", f"data.max_response_length={MAX_RESPONSE}",
            f"actor_rollout_ref.rollout.n={N}", "trainer.experiment_name=verl-test", *overrides])


def make_batch(n_prompts: int = 4, seed: int = 0, response_lengths: list[int] | None = None,
               prompt_lengths: list[int] | None = None, width: int | None = None, noise: float = 0.3,
               versions: tuple[list, list] | None = None, sources: tuple[str, ...] = ("gsm8k", "math")):
    """A training batch as ``RayPPOTrainer.fit`` holds it at ``compute_data_metrics`` time.

    ``width``: the padded response width (default: the configured max response length, as the v0
    agent loop pads; pass the batch maximum to get a v1-style ``to_padded_tensor`` batch)."""
    import numpy as np

    from verl import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage

    g = torch.Generator().manual_seed(seed)
    B = n_prompts * N
    r_len = torch.tensor(response_lengths) if response_lengths is not None else \
        torch.randint(1, MAX_RESPONSE + 1, (B,), generator=g)
    p_len = torch.tensor(prompt_lengths) if prompt_lengths is not None else \
        torch.randint(2, MAX_PROMPT + 1, (B,), generator=g)
    R = width or MAX_RESPONSE
    positions_r, positions_p = torch.arange(R)[None], torch.arange(MAX_PROMPT)[None]
    response_mask = (positions_r < r_len[:, None]).long()
    prompt_mask = (positions_p >= MAX_PROMPT - p_len[:, None]).long()            # left padded
    responses = torch.randint(3, 100, (B, R), generator=g) * response_mask
    prompts = torch.randint(3, 100, (B, MAX_PROMPT), generator=g) * prompt_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    rollout = (-torch.rand(B, R, generator=g) * 3) * response_mask
    old = (rollout + noise * torch.randn(B, R, generator=g)) * response_mask
    scores = torch.zeros(B, R)
    scores[torch.arange(B), (r_len - 1).clamp(min=0)] = torch.randint(0, 2, (B,), generator=g).float()

    # The prompt batch: one uid per prompt, then repeated n times (interleaved) as fit does.
    prompt_batch = DataProto.from_single_dict({
        "dummy_tensor": torch.zeros(n_prompts, 1, dtype=torch.uint8),         # RLHFDataset's only tensor
        "uid": np.array([str(uuid.UUID(int=seed * 1000 + i)) for i in range(n_prompts)], dtype=object),
        "data_source": np.array([sources[i % len(sources)] for i in range(n_prompts)], dtype=object),
    })
    batch = prompt_batch.repeat(repeat_times=N, interleave=True)
    first, last = versions if versions is not None else ([4] * B, [4] * B)
    gen = DataProto.from_single_dict({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "rollout_log_probs": rollout,
        "__num_turns__": np.full(B, 2, dtype=np.int32),
        "min_global_steps": np.array(first, dtype=object), "max_global_steps": np.array(last, dtype=object),
    })
    batch = batch.union(gen)
    batch = batch.union(DataProto.from_single_dict({"old_log_probs": old}))
    batch.batch["token_level_scores"] = scores
    batch.batch["token_level_rewards"] = scores
    batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=N)
    batch.meta_info["global_token_num"] = attention_mask.sum(-1).tolist()
    return batch


def expected_fields(batch, trainer_version: int, truncated) -> dict:
    """The observe fields written out by hand from the batch (what rlwatch should have read)."""
    b, extra = batch.batch, batch.non_tensor_batch
    return dict(mask=b["response_mask"], sampler_logp=b["rollout_log_probs"], trainer_logp=b["old_log_probs"],
                seq_version=torch.tensor([[int(a), int(z)] for a, z in zip(extra["min_global_steps"],
                                                                            extra["max_global_steps"])]),
                trainer_version=trainer_version, rewards=b["token_level_scores"].sum(-1),
                group_ids=list(extra["uid"]), env=list(extra["data_source"]), truncated=truncated,
                failed=[None] * len(batch))


def assert_values_match(got: dict, expected: dict) -> None:
    for name, series in expected.items():
        if name.startswith("_") or name in TIMING_KEYS:
            continue
        assert name in got, name
        for labels, value in series.items():
            mine = got[name].get(labels)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                assert mine is None or math.isnan(mine), (name, labels, mine)
            else:
                assert mine == pytest.approx(value, rel=1e-6, abs=1e-9), (name, labels)


def same_metrics(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    for key in a:
        x, y = float(a[key]), float(b[key])
        if not (x == y or (math.isnan(x) and math.isnan(y))):
            return False
    return True


def separation_trainer(config, global_steps: int):
    """A real ``SeparateRayPPOTrainer`` (the base of fully-async and one-step-off) without its Ray
    workers: just what ``_fit_collect_metrics`` reads."""
    from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer

    trainer = object.__new__(SeparateRayPPOTrainer)
    trainer.config = config
    trainer.global_steps = global_steps
    trainer.use_critic = False
    trainer.metrics = {}
    trainer.timing_raw = {"step": 2.0, "gen": 1.0, "update_actor": 0.5}
    trainer.resource_pool_manager = SimpleNamespace(get_n_gpus=lambda: 1)
    return trainer


# --- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def config():
    need_module("verl")
    need_module("hydra")
    return compose_config()


@pytest.fixture
def instrumented(tmp_path):
    """verl instrumented in this process, reporting to a strict Watch with a run store."""
    from rlwatch.integrations import verl as rv

    watch = Watch(run="verl-test", port=None, store=str(tmp_path / "run.db"), strict=True, group_size=N,
                  alerts=False)
    assert rv.instrument(watch=watch)
    yield rv.INSTRUMENTOR, watch
    rv.uninstrument()
    watch.close()


# --- compute_data_metrics (v0, separation, fully-async, one-step-off) ------------------------------

def test_every_module_holding_compute_data_metrics_gets_the_wrapper(config, tmp_path, monkeypatch):
    import importlib

    import verl.experimental.separation.ray_trainer as separation
    import verl.trainer.ppo.metric_utils as metric_utils
    import verl.trainer.ppo.ray_trainer as ray_trainer
    import verl.trainer.ppo.v1.trainer_base as v1
    from rlwatch.integrations import verl as rv

    for name in ("recipe_before", "recipe_after"):      # a user's recipe, as verl's recipes import it
        (tmp_path / f"{name}.py").write_text("from verl.trainer.ppo.metric_utils import compute_data_metrics\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = importlib.import_module("recipe_before")
    original = metric_utils.compute_data_metrics
    assert rv.instrument(watch=Watch(port=None, store=None))
    try:
        for module in (metric_utils, ray_trainer, separation, v1, before):
            assert module.compute_data_metrics.__rlwatch_original__ is original, module.__name__
        after = importlib.import_module("recipe_after")           # binds the wrapper at import time
        assert after.compute_data_metrics is metric_utils.compute_data_metrics
    finally:
        rv.uninstrument()
        for name in ("recipe_before", "recipe_after"):
            sys.modules.pop(name, None)
    for module in (metric_utils, ray_trainer, separation, v1, before, after):
        assert module.compute_data_metrics is original, module.__name__


def test_compute_data_metrics_unchanged_and_values_equal_compute(config, instrumented):
    import verl.trainer.ppo.metric_utils as metric_utils

    instr, watch = instrumented
    batch = make_batch(seed=1, versions=([3] * 8 + [2] * 8, [4] * 8 + [3] * 8))
    reference = metric_utils.compute_data_metrics.__rlwatch_original__(batch=copy.deepcopy(batch), use_critic=False)
    trainer = separation_trainer(config, global_steps=5)

    trainer._fit_collect_metrics(batch)          # the real trainer method, through its own import

    theirs = {k: trainer.metrics[k] for k in reference}
    assert same_metrics(theirs, reference)
    lengths = batch.batch["response_mask"].sum(-1)
    fields = expected_fields(batch, trainer_version=4, truncated=lengths == MAX_RESPONSE)
    expected = compute(SignalConfig(group_size=N), step=5, temperature=1.0, top_p=1.0, top_k=-1, **fields)
    assert_values_match(instr.last_values, expected)
    assert instr.last_values["step"][()] == 5
    # Trajectories generated across versions 3-4 and 2-3 trained from version 4: lag 1 and 2.
    assert instr.last_values["version_lag_max"][()] == 2
    assert instr.last_values["partial_rollout_ratio"][()] == 1.0
    assert instr.last_values["env_episodes"] == {("gsm8k",): 8.0, ("math",): 8.0}
    assert watch.errors.total() == 0


def test_episode_durations_and_phases_from_verls_own_timers(config, instrumented):
    """The real AgentLoopManager._performance_metrics (verl's per-sample generate/tool/score timers)
    leaves each sample's seconds on its output batch, which follows the samples through union into the
    trained batch; the phases are the step's timing_raw (gen, update_actor, update_weights)."""
    import numpy as np

    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    instr, watch = instrumented
    batch = make_batch(seed=2)
    B = len(batch)
    g = torch.Generator().manual_seed(3)
    gen, tool, score = (torch.rand(B, generator=g) * 60).tolist(), (torch.rand(B, generator=g) * 30).tolist(), [0.5] * B
    per_worker = [[{"generate_sequences": gen[i], "tool_calls": tool[i], "compute_score": score[i], "num_preempted": 0}
                   for i in range(start, start + B // 2)] for start in (0, B // 2)]
    output = DataProto.from_single_dict({"prompts": batch.batch["prompts"],
                                         "attention_mask": batch.batch["attention_mask"]})
    manager = object.__new__(AgentLoopManager)
    timing = manager._performance_metrics(per_worker, output)
    assert timing["agent_loop/generate_sequences/max"] == max(gen)            # verl's own output unchanged
    seconds = output.non_tensor_batch.pop("rlwatch_episode_seconds")
    batch.non_tensor_batch["rlwatch_episode_seconds"] = seconds             # as union carries it
    trainer = separation_trainer(config, global_steps=5)
    trainer.timing_raw = {"step": 9.0, "gen": 4.0, "update_actor": 2.5, "update_weights": 1.25, "testing": 7.0,
                          "agent_loop/slowest/tool_calls": 3.0}
    trainer._fit_collect_metrics(batch)

    values = instr.last_values
    durations = torch.tensor(gen) + torch.tensor(tool) + 0.5
    assert values["episode_duration_max_seconds"][()] == pytest.approx(durations.max().item())
    assert values["episode_duration_p50_seconds"][()] == pytest.approx(durations.quantile(0.5).item())
    assert values["straggler_wait_seconds"][()] == pytest.approx((durations.max() - durations.quantile(0.5)).item())
    sources = np.asarray(batch.non_tensor_batch["data_source"])
    for env in ("gsm8k", "math"):
        assert values["env_episode_duration_mean_seconds"][(env,)] == pytest.approx(
            durations[torch.tensor(sources == env)].mean().item())
    assert values["phase_seconds"] == {("generation",): 4.0, ("training",): 2.5, ("sync",): 1.25}
    assert values["weight_sync_seconds"][()] == 1.25
    assert watch.errors.total() == 0


def test_mismatch_agrees_with_verl_rollout_correction(config, instrumented):
    import verl.trainer.ppo.ray_trainer as ray_trainer
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    instr, _ = instrumented
    batch = make_batch(seed=2, noise=0.5)

    class Trainer:          # calls it from a method, as RayPPOTrainer.fit does
        def __init__(self) -> None:
            self.config, self.global_steps = config, 5

        def fit_step(self, batch):
            return ray_trainer.compute_data_metrics(batch=batch, use_critic=False)

    Trainer().fit_step(batch)
    b = batch.batch
    _, _, theirs = compute_rollout_correction_and_rejection_mask(
        b["old_log_probs"], b["rollout_log_probs"], b["response_mask"].float(), rollout_is="token",
        rollout_is_threshold=2.0)
    ours = instr.last_values
    for verl_key, ours_key in {"kl": "mismatch_kl_k1", "k3_kl": "mismatch_kl_k3",
                               "chi2_token": "mismatch_chi2_token", "chi2_seq": "mismatch_chi2_sequence",
                               "rollout_is_eff_sample_size": "is_ess_ratio",
                               "rollout_is_ratio_fraction_high": "is_tis_high_ratio"}.items():
        assert ours[ours_key][()] == pytest.approx(theirs[f"rollout_corr/{verl_key}"], rel=2e-5, abs=1e-7), verl_key


def test_truncation_uses_true_lengths_not_the_padded_width(tmp_path):
    """verl's response_length/clip_ratio compares lengths with responses.shape[-1]. Padded to the
    batch maximum (as v1 pads) the longest responses count as clipped though none hit the
    configured 16 tokens; and a response stopped by max_model_len - prompt_length is not seen."""
    need_module("verl")
    import verl.trainer.ppo.metric_utils as metric_utils
    from rlwatch.integrations import verl as rv

    config = compose_config("actor_rollout_ref.rollout.max_model_len=20")
    lengths = [10, 3, 7, 10, 5, 9, 12, 2]
    prompts = [4, 5, 6, 8, 3, 7, 8, 2]                  # row 6: 8 + 12 = max_model_len
    batch = make_batch(n_prompts=2, seed=3, response_lengths=lengths, prompt_lengths=prompts, width=max(lengths))
    watch = Watch(port=None, store=None, strict=True)
    assert rv.instrument(watch=watch)
    try:
        theirs = separation_trainer(config, global_steps=5)
        theirs._fit_collect_metrics(batch)
    finally:
        rv.uninstrument()
        watch.close()
    assert theirs.metrics["response_length/clip_ratio"] == pytest.approx(1 / 8)    # the row of 12 = width
    assert rv.INSTRUMENTOR.last_values["truncated_ratio"][()] == pytest.approx(1 / 8)   # row 6, by max_model_len
    flags = rv.truncation_flags(torch.tensor(lengths), torch.tensor(prompts), MAX_RESPONSE, 20)
    assert flags.tolist() == [False] * 6 + [True, False]
    # Without max_model_len nothing here is truncated; verl still reports 1/8.
    assert not rv.truncation_flags(torch.tensor(lengths), torch.tensor(prompts), MAX_RESPONSE, None).any()
    assert rv.truncation_flags(torch.tensor([16, 15, 0]), None, MAX_RESPONSE).tolist() == [True, False, False]
    assert not hasattr(metric_utils.compute_data_metrics, "__rlwatch_original__")
    # A finish reason in the batch (a custom agent loop's extra_fields) wins over the lengths.
    import numpy as np

    batch.non_tensor_batch["finish_reason"] = np.array(["stop"] * 7 + ["length"], dtype=object)
    assert rv.fields_from_dataproto(batch, config)["truncated"].tolist() == [False] * 7 + [True]


def test_bypass_mode_reports_no_mismatch_and_bad_fields_are_counted_not_raised(config):
    from rlwatch.integrations import verl as rv

    batch = make_batch(seed=4)
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]       # what apply_bypass_mode does
    batch.non_tensor_batch["min_global_steps"][0] = "not-a-version"
    watch = Watch(port=None, store=None)                                   # default: never raises
    assert rv.instrument(watch=watch)
    try:
        trainer = separation_trainer(config, global_steps=5)
        trainer._fit_collect_metrics(batch)
        assert "critic/score/mean" in trainer.metrics
        assert watch.errors.snapshot() == {("integration", "verl_compute_data_metrics"): 1}
        del batch.non_tensor_batch["min_global_steps"], batch.non_tensor_batch["max_global_steps"]
        trainer._fit_collect_metrics(batch)
        values = rv.INSTRUMENTOR.last_values
        assert "mismatch_kl_k1" not in values and values["sequences"][()] == 16
    finally:
        rv.uninstrument()
        watch.close()


# --- v1 trainer: TransferQueue ---------------------------------------------------------------------

@pytest.fixture
def transfer_queue():
    """A real TransferQueue (controller + one SimpleStorage unit) on a local Ray instance. Each
    is a Ray actor asking for one CPU, so Ray gets two logical CPUs."""
    need_module("verl")
    ray = need_module("ray")
    tq = need_module("transfer_queue")
    from omegaconf import OmegaConf

    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        yield tq
    finally:
        try:
            tq.close()
        finally:
            ray.shutdown()


def put_v1_batch(tq, batch, partition: str = "train", padding_rows: int = 1):
    """Write ``batch`` into TransferQueue the way the v1 agent loop and trainer do: jagged
    per-sample fields, non-tensor uid/data_source, tags with lengths and policy versions; plus
    ``padding_rows`` copies tagged ``is_padding`` (upsample_batch_to_divisible_size)."""
    from tensordict import TensorDict

    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.utils.padding import response_to_nested

    b, extra = batch.batch, batch.non_tensor_batch
    lengths = b["response_mask"].sum(-1).tolist()
    prompt_lengths = b["attention_mask"][:, :MAX_PROMPT].sum(-1).tolist()
    rows, keys, tags = [], [], []
    index = list(range(len(batch))) + list(range(padding_rows))
    for j, i in enumerate(index):
        n, p, padding = int(lengths[i]), int(prompt_lengths[i]), j >= len(batch)
        rows.append({"prompts": b["prompts"][i, MAX_PROMPT - p:], "responses": b["responses"][i, :n],
                     "response_mask": b["response_mask"][i, :n], "rollout_log_probs": b["rollout_log_probs"][i, :n],
                     "rm_scores": b["token_level_scores"][i, :n], "uid": extra["uid"][i],
                     "data_source": extra["data_source"][i], "num_turns": 2})
        keys.append(f"{extra['uid'][i]}_{i}_{'pad' if padding else 0}")
        tags.append({"status": "success", "prompt_len": p, "response_len": n, "seq_len": p + n,
                     "min_global_steps": int(extra["min_global_steps"][i]),
                     "max_global_steps": int(extra["max_global_steps"][i]),
                     **({"is_padding": True} if padding else {})})
    tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(rows), tags=tags, partition_id=partition)
    nested_mask = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=["response_mask"])["response_mask"]
    trainer_side = {name: response_to_nested(b[name][index], nested_mask)
                    for name in ("old_log_probs", "advantages", "returns")}
    tq.kv_batch_put(keys=keys, partition_id=partition, fields=TensorDict(trainer_side, batch_size=len(keys)))
    from transfer_queue import KVBatchMeta

    return KVBatchMeta(keys=keys, tags=tags, partition_id=partition)


class RaisingQueue:
    """TransferQueue as versions behave that raise ValueError on a field they do not hold."""

    def __init__(self, tq, missing: str) -> None:
        self.tq, self.missing = tq, missing

    def kv_batch_get(self, keys, partition_id, select_fields):
        if self.missing in select_fields:
            raise ValueError(f"field {self.missing} not found")
        return self.tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=select_fields)


def test_v1_compute_metrics_reads_transfer_queue(config, instrumented, transfer_queue):
    import verl.trainer.ppo.v1.trainer_sync as trainer_sync  # a concrete, registered v1 trainer
    from rlwatch.integrations import verl as rv

    instr, watch = instrumented
    tq = transfer_queue
    lengths = [5, 9, 3, 12, 7, 1, 11, 6, 4, 8, 10, 2, 9, 5, 7, 3]
    batch = make_batch(seed=5, response_lengths=lengths,
                       versions=([4] * 12 + [3] * 4, [4] * 12 + [4] * 4))
    meta = put_v1_batch(tq, batch)
    trainer = object.__new__(trainer_sync.PPOTrainerSync)
    trainer.config, trainer.use_critic, trainer.global_steps = config, False, 5
    trainer._rollout_moe_lb_metrics_accumulator = None
    trainer.resource_pool_manager = SimpleNamespace(get_n_gpus=lambda: 1)
    metrics = {}
    try:
        trainer._compute_metrics(meta, metrics, {"step": 2.0, "gen": 1.0, "update_actor": 0.5}, global_steps=5,
                                 epoch=0)
        # TransferQueue versions that raise on a field nobody stored (verl expects that for
        # routed_experts): rlwatch then fetches field by field and gets the same record.
        lenient = rv.fields_from_transfer_queue(tq, meta, config, trainer_version=4)
        fallback = rv.fields_from_transfer_queue(RaisingQueue(tq, missing="entropy"), meta, config, trainer_version=4)
    finally:
        tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)
    assert lenient.keys() == fallback.keys() and "entropy" not in lenient
    for name, value in lenient.items():
        assert torch.equal(value, fallback[name]) if isinstance(value, torch.Tensor) else value == fallback[name]

    # verl's own numbers, computed from its stripped batch (padded to the batch maximum, 12 tokens).
    assert metrics["response_length/max"] == 12
    assert metrics["response_length/clip_ratio"] == pytest.approx(1 / 16)          # verl#7817
    assert metrics["training/off_policy/trajectory_staleness/max"] == 0
    # rlwatch's, from the full per-token fields it fetched before kv_clear; padding row left out.
    mask = batch.batch["response_mask"][:, :12]
    fields = expected_fields(batch, trainer_version=4, truncated=torch.zeros(16, dtype=torch.bool))
    fields.update(mask=mask, sampler_logp=fields["sampler_logp"][:, :12], trainer_logp=fields["trainer_logp"][:, :12])
    expected = compute(SignalConfig(group_size=N), step=5, temperature=1.0, top_p=1.0, top_k=-1, **fields)
    assert_values_match(instr.last_values, expected)
    assert instr.last_values["sequences"][()] == 16
    assert instr.last_values["truncated_ratio"][()] == 0
    assert instr.last_values["phase_seconds"] == {("generation",): 1.0, ("training",): 0.5}    # its timing_raw
    assert instr.last_values["version_lag_max"][()] == 1          # first versions 3 against trainer 4
    assert watch.errors.total() == 0


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


# --- delivery into Ray workers -------------------------------------------------------------------

def ray_init_kwargs_from_main_ppo(env_vars: dict, config=None) -> dict:
    """The ray.init keyword arguments that verl's own ``run_ppo`` builds from the documented
    override (``ray.init`` is intercepted; nothing else of main_ppo runs)."""
    import verl.trainer.main_ppo as main_ppo

    if config is None:
        overrides = [f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}"]
        # Quoted: Hydra would make RLWATCH_PORT=0 an int, and Ray accepts only string env_vars.
        overrides += [f'+ray_kwargs.ray_init.runtime_env.env_vars.{k}="{v}"' for k, v in env_vars.items()]
        config = compose_config(*overrides)
    captured: dict = {}

    class Captured(Exception):
        pass

    def fake_init(**kwargs):
        captured.update(kwargs)
        raise Captured

    real_init, main_ppo.ray.init = main_ppo.ray.init, fake_init
    try:
        with pytest.raises(Captured):
            main_ppo.run_ppo(config, task_runner_class=None)
    finally:
        main_ppo.ray.init = real_init
    return captured


def test_example_launch_line_composes_and_reaches_ray_init(tmp_path):
    """examples/verl_launch.sh, run with a stand-in python3 that records its arguments: verl's
    Hydra config accepts every override and run_ppo hands Ray the hook and string env_vars."""
    need_module("hydra")
    import subprocess

    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "$ARGS_OUT"\n')
    shim.chmod(0o755)
    out = tmp_path / "args"
    subprocess.run(["bash", str(ROOT / "examples" / "verl_launch.sh")], check=True, timeout=60,
                   env=dict(os.environ, PATH=f"{shim.parent}:{os.environ['PATH']}", ARGS_OUT=str(out), RUN="demo"))
    args = out.read_text().splitlines()
    assert args[:2] == ["-m", "verl.trainer.main_ppo"]
    overrides = [a for a in args[2:] if not a.startswith(("data.max_prompt_length", "data.max_response_length",
                                                          "actor_rollout_ref.rollout.n=", "trainer.experiment_name"))]
    kwargs = ray_init_kwargs_from_main_ppo({}, compose_config(*overrides))
    env = kwargs["runtime_env"]
    assert env["worker_process_setup_hook"] == HOOK
    assert env["env_vars"]["RLWATCH_RUN"] == "demo" and env["env_vars"]["RLWATCH_PORT"] == "9400"
    assert all(isinstance(v, str) for v in env["env_vars"].values())


class TrainerProcess:
    """Stands in for verl's TaskRunner actor: imports verl's metric module and calls it from a
    trainer method, like RayPPOTrainer.fit."""

    def state(self) -> dict:
        from rlwatch.integrations import verl as rv

        return {"verl_imported": "verl" in sys.modules, "instrumented": rv.INSTRUMENTOR.is_instrumented,
                "watch": rv.INSTRUMENTOR.watch is not None, "pid": os.getpid()}

    def train_step(self) -> dict:
        import verl.trainer.ppo.metric_utils as metric_utils
        from omegaconf import OmegaConf

        from rlwatch.integrations import verl as rv

        self.config = OmegaConf.create({"trainer": {"experiment_name": "ignored-env-wins"},
                                        "actor_rollout_ref": {"rollout": {"n": N, "response_length": MAX_RESPONSE}}})
        self.global_steps = 1
        metrics = metric_utils.compute_data_metrics(batch=make_batch(seed=6), use_critic=False)
        watch = rv.INSTRUMENTOR.watch
        return {"wrapped": hasattr(metric_utils.compute_data_metrics, "__rlwatch_original__"),
                "verl_metric": metrics["critic/score/mean"], "port": watch.port, "run": watch.run,
                "steps": rv.INSTRUMENTOR.last_values["steps_total"][()]}

    def close(self) -> None:
        from rlwatch.integrations import verl as rv

        rv.uninstrument()


def test_setup_hook_reaches_the_trainer_actor_through_ray(tmp_path):
    ray = need_module("ray")
    need_module("hydra")
    sd_dir = tmp_path / "targets"
    kwargs = ray_init_kwargs_from_main_ppo({"RLWATCH_RUN": "from-ray", "RLWATCH_PORT": "0",
                                            "RLWATCH_STORE": "none", "RLWATCH_SD_DIR": str(sd_dir)})
    runtime_env = kwargs["runtime_env"]
    assert runtime_env["worker_process_setup_hook"] == HOOK
    runtime_env["env_vars"]["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])
    try:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
        remote = ray.remote(num_cpus=0)(TrainerProcess)
        trainer, bystander = remote.remote(), remote.remote()
        before = ray.get(trainer.state.remote())
        assert before == {"verl_imported": False, "instrumented": True, "watch": False, "pid": before["pid"]}
        step = ray.get(trainer.train_step.remote())
        assert step["wrapped"] and step["run"] == "from-ray" and step["steps"] == 1
        assert math.isfinite(step["verl_metric"])
        body = urllib.request.urlopen(f"http://127.0.0.1:{step['port']}/metrics", timeout=10).read().decode()
        assert re.search(r'rlwatch_steps_total\{run="from-ray",run_instance="[^"]+"\} 1.0', body), body
        assert len(list(sd_dir.glob("*.json"))) == 1              # registered for Prometheus file_sd
        idle = ray.get(bystander.state.remote())
        assert idle["pid"] != before["pid"]
        assert idle == {"verl_imported": False, "instrumented": True, "watch": False, "pid": idle["pid"]}
        ray.get(trainer.close.remote())
        assert not list(sd_dir.glob("*.json"))
    finally:
        ray.shutdown()


@pytest.mark.frameworks          # verl must be installed for the hook to patch it
def test_setup_hook_imports_no_verl():
    """The worker setup hook only registers the import hook: it imports no verl."""
    code = ("import sys; import rlwatch.integrations.verl as rv; rv.setup_hook(); "
            "print(any(m == 'verl' or m.startswith('verl.') for m in sys.modules), "
            "rv.INSTRUMENTOR.is_instrumented)")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    imported, instrumented = out.stdout.split()
    assert imported == "False" and instrumented == "True", out.stderr


def test_reward_extra_info_reaches_the_hack_detectors(config, tmp_path):
    """The reward manager's per-sample extra info (here a checker's ``true_pass``) flows into the
    built-in verifier_disagreement detector, per data_source."""
    import numpy as np

    from rlwatch.integrations import verl as rv

    watch = Watch(run="verl-hacks", port=None, store=None, group_size=N, alerts=False)
    assert rv.instrument(watch=watch)
    try:
        batch = make_batch(seed=3)
        B = len(batch.non_tensor_batch["uid"])
        batch.batch["token_level_scores"] = torch.zeros_like(batch.batch["token_level_scores"])
        batch.batch["token_level_scores"][:, 0] = 1.0                        # every sample rewarded
        sources = batch.non_tensor_batch["data_source"]
        batch.non_tensor_batch["true_pass"] = np.array([s != "math" for s in sources], dtype=object)
        separation_trainer(config, global_steps=2)._fit_collect_metrics(batch)
        watch.hacks.flush()
        watch.observe(3, mask=torch.ones(1, 1))
        hacked = watch.state.snapshot().counters["episodes_hacked_total"]
    finally:
        rv.uninstrument()
        watch.close()
    assert hacked[("math", "verifier_disagreement")] == sum(1 for s in sources if s == "math")
    assert hacked[("gsm8k", "verifier_disagreement")] == 0
    assert B > 0
