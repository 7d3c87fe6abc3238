"""Shared by the verl tests (tests/test_verl_*.py): verl's config composed with Hydra, training batches
built with verl's own DataProto as its trainers build them, and the values rlwatch should have read."""

from __future__ import annotations

import math
import os
import uuid
from types import SimpleNamespace

import torch

HOOK = "rlwatch.integrations.verl.setup_hook"
N = 4                      # rollout.n
MAX_PROMPT, MAX_RESPONSE = 8, 16


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
