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
import sys
from types import SimpleNamespace

import pytest
import torch

from rlwatch import SignalConfig, Watch, compute

from .conftest import need_module
from ._values import assert_values_close
from ._verl_helpers import (MAX_PROMPT, MAX_RESPONSE, N, compose_config, expected_fields,
                            make_batch, same_metrics, separation_trainer)


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
    assert_values_close(instr.last_values, expected)
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
    assert_values_close(instr.last_values, expected)
    assert instr.last_values["sequences"][()] == 16
    assert instr.last_values["truncated_ratio"][()] == 0
    assert instr.last_values["phase_seconds"] == {("generation",): 1.0, ("training",): 0.5}    # its timing_raw
    assert instr.last_values["version_lag_max"][()] == 1          # first versions 3 against trainer 4
    assert watch.errors.total() == 0


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
