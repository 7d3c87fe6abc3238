"""A tiny, real GRPO training in pure torch that reproduces the stale-policy story on demand.

A GRU policy (about 20k parameters, 15-token vocabulary; ``policy="transformer"``: a two-layer causal
transformer of about the same size) answers digit-string prompts in two environments: ``copy`` (answer
the prompt's digits, then EOS) and ``reverse`` (answer them reversed), or with ``tasks="sort-shift"``
``sort`` and ``shift``. It starts from a short supervised warm start on imperfect demonstrations (a share of
the digits is wrong and 60% of the answers carry one extra digit, so the base policy answers too long), then
trains by GRPO: ``group_size`` samples per prompt, group-normalised advantages of a 0/1 exact-match
reward, PPO-clipped ratio ``pi_theta / pi_old`` with ``pi_old`` recomputed by the trainer, Adam,
``epochs x minibatches`` updates per step. The behaviour policy ``mu`` that samples is the policy
``lag`` updates old; the decoupled loss multiplies the advantages by a behaviour weight
``w = pi_old / mu`` (``correction``: "none" -> 1, "tis" -> min(w, C), "mis" -> w inside a band, 0 out).

Why the stories happen (measured by ``python -m evaluation.calibrate``):

- RL first fixes the base's too-long answers, which needs EOS pushed earlier. Without correction,
  an update from data 8 versions old keeps pushing down the long answers that the old policy still
  produced after the current one has stopped producing them, and overshoots: answers become too
  short, often empty. A group whose 8 answers all fail has zero advantage, so the short/empty policy
  is absorbing and the held-out true reward collapses. At lag 0 or 2 the feedback is fast enough to
  stop at the right length; TIS down-weights exactly the tokens the current policy has abandoned
  (``pi_old / mu`` small), which removes most of the overshoot.
- ``hack=True`` puts a bug in the ``reverse`` grader (it compares ``zip(answer, target)``, so any
  prefix of the target, the empty answer included, gets reward 1); short answers are easier to get
  right, so the policy drifts into the exploit there while ``copy`` stays clean.
- ``sampler_temperature`` / ``sampler_top_p`` make the sampler draw from, and report log-probs of, a
  different distribution than the trainer's; ``partial_rollouts`` splices two versions into one
  sequence. A monitor sees these in ``trainer_logp - sampler_logp`` from step 0.

Held-out evaluation: 128 fixed prompts whose two-digit strings never occur in training (see
:func:`rlwatch.demo.tasks._apply_heldout_rule`), answered by the current policy with a fixed sampling
seed, scored by the true checker. Runs are deterministic for a given seed and thread count (``threads``, default 1; a
different thread count changes float rounding and therefore the trajectory).

Conventions: ``B`` episodes per step (``prompts_per_step * group_size``), ``P`` prompt length
(left-padded), ``T`` = ``max_response`` response positions, ``V`` vocabulary size. Log-probs are in
nats.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

# The parts of a run, one module per concern: config (its settings), tasks (prompts, graders), policy
# (models, sampling), grpo (the update, the warm start, the evaluation). Their names stay importable here.
from .config import TASK_SETS, ScenarioConfig
from .grpo import behaviour_weights, evaluate, group_advantages, ppo_update, pretrain, token_logp_entropy
from .policy import Policy, TransformerPolicy, _snapshot, make_policy, sample
from .tasks import DIGITS, ENV_NAMES, ENV_TOKEN, EOS, PAD, SEP, VOCAB, grade, make_prompts

__all__ = ["DIGITS", "ENV_NAMES", "ENV_TOKEN", "EOS", "PAD", "SEP", "SCENARIOS", "TASK_SETS", "VOCAB", "Policy",
           "ScenarioConfig", "ScenarioResult", "StepInfo", "TransformerPolicy", "behaviour_weights", "collapse_step",
           "evaluate", "grade", "group_advantages", "make_policy", "make_prompts", "ppo_update", "pretrain",
           "run_scenario", "sample", "save_probe_rollouts", "scenario", "token_logp_entropy"]


SCENARIOS: dict[str, ScenarioConfig] = {
    "healthy": ScenarioConfig(),
    "lag2": ScenarioConfig(lag=2),
    "collapse": ScenarioConfig(lag=8),
    "rescued": ScenarioConfig(lag=8, correction="tis"),
    "mis": ScenarioConfig(lag=8, correction="mis"),
    "hack": ScenarioConfig(hack=True),
    "temperature_fault": ScenarioConfig(sampler_temperature=0.6),
    "top_p_fault": ScenarioConfig(sampler_top_p=0.9),
    "partial": ScenarioConfig(lag=2, partial_rollouts=True),
}


@dataclass
class StepInfo:
    """What one step hands to ``on_step``: ``fields`` are ``observe(step, **fields)``'s keywords."""

    step: int
    fields: dict
    episodes: list[dict]
    metrics: dict


@dataclass
class ScenarioResult:
    """A finished run: per-step metrics, (step, held-out true reward) pairs and wall seconds."""

    config: ScenarioConfig
    history: list[dict] = field(default_factory=list)
    heldout: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0


def collapse_step(heldout: list[tuple[int, float]]) -> int | None:
    """First step from which the held-out true reward stays below half its running peak until the
    end of the run; None if the last point is not below half the peak (or the peak is 0)."""
    start = None
    peak = float("-inf")
    for step, value in heldout:
        peak = max(peak, value)
        below = peak > 0 and value < 0.5 * peak
        if below and start is None:
            start = step
        elif not below:
            start = None
    return start


def save_probe_rollouts(path: str, config: ScenarioConfig) -> str:
    """Write the fixed rollouts ``rlwatch postmortem --probe`` scores each checkpoint on: the run's
    held-out prompts answered correctly (the target digits, then EOS), ``input_ids`` [N, P + K + 1]
    with the prompt left-padded as in training, ``response_mask`` on the answer and its EOS."""
    from ..postmortem.probe import save_rollouts

    heldout = make_prompts(config.heldout_prompts // 2, config, torch.Generator().manual_seed(12345), heldout=True)
    prompts, targets, lengths = heldout["prompts"], heldout["targets"], heldout["target_len"]
    answer = torch.cat([targets, torch.full((len(targets), 1), PAD)], dim=1)
    answer = answer.scatter(1, lengths[:, None], EOS)                           # EOS after the last digit
    ids = torch.cat([prompts, answer], dim=1)
    positions = torch.arange(answer.shape[1])[None, :]
    response = torch.cat([torch.zeros_like(prompts), (positions <= lengths[:, None]).long()], dim=1)
    save_rollouts(path, ids, (ids != PAD).long(), response)
    return path


def _save_checkpoint(model: Policy, config: ScenarioConfig, step: int, trainer_version: int, root: str) -> str:
    from safetensors.torch import save_file

    path = os.path.join(root, f"checkpoint-{step}")
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))
    meta = {"step": step, "trainer_version": trainer_version, "vocab_size": VOCAB,
            "embed_dim": config.embed_dim, "hidden_dim": config.hidden_dim, "architecture": config.policy,
            "scenario": asdict(config)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return path


def _episodes(batch: dict[str, torch.Tensor], rewards: torch.Tensor, true_pass: torch.Tensor,
              names: tuple[str, ...] = ENV_NAMES) -> list[dict]:
    """Per-episode dicts (built once per step from host lists, outside the hot path)."""
    prompts = batch["prompts"].tolist()
    responses = batch["responses"].tolist()
    lengths = batch["mask"].sum(1).tolist()
    envs, rs, tp, tr = batch["env"].tolist(), rewards.tolist(), true_pass.tolist(), batch["truncated"].tolist()
    return [{"env": names[e], "prompt": [x for x in p if x != PAD], "response": r[:n], "reward": rw,
             "true_pass": bool(ok), "truncated": bool(t)}
            for p, r, n, e, rw, ok, t in zip(prompts, responses, lengths, envs, rs, tp, tr)]


def run_scenario(config: ScenarioConfig, on_step: Callable[[StepInfo], None] | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 5,
                 on_checkpoint: Callable[[int, str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> ScenarioResult:
    """Train for ``config.steps`` steps and report each one through ``on_step``.

    Checkpoints (when ``checkpoint_dir`` is given) hold the weights after the update of step
    ``s`` and are written as ``checkpoint-{s}`` for every ``s`` with ``(s + 1) % checkpoint_every
    == 0``. ``should_stop`` is polled once after each step.
    """
    previous_threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _run(config, on_step, checkpoint_dir, checkpoint_every, on_checkpoint, should_stop)
    finally:
        torch.set_num_threads(previous_threads)


#: Warm-started weights and the global RNG state after the warm start, by the settings it reads (runs
#: that differ only in their RL settings share it; the evaluation trains many such runs).
_WARM_STARTS: dict[tuple, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
_WARM_START_FIELDS = ("seed", "policy", "tasks", "embed_dim", "hidden_dim", "pretrain_steps", "pretrain_lr",
                      "pretrain_noise", "pretrain_extra", "min_digits", "max_digits", "length_weights",
                      "max_response", "prompts_per_step", "group_size")


def _warm_started(config: ScenarioConfig) -> Policy:
    """The policy after the supervised warm start, trained once per warm-start setting and process."""
    key = (torch.get_num_threads(), *(getattr(config, name) for name in _WARM_START_FIELDS))
    if key not in _WARM_STARTS:
        torch.manual_seed(config.seed)
        model = make_policy(config)
        pretrain(model, config, torch.Generator().manual_seed(config.seed + 1_000_003))
        if len(_WARM_STARTS) >= 16:
            _WARM_STARTS.pop(next(iter(_WARM_STARTS)))
        _WARM_STARTS[key] = (_snapshot(model), torch.get_rng_state())
    state, rng = _WARM_STARTS[key]
    model = make_policy(config)
    model.load_state_dict(state)
    torch.set_rng_state(rng)
    return model


def _run(config: ScenarioConfig, on_step: Callable[[StepInfo], None] | None, checkpoint_dir: str | None,
         checkpoint_every: int, on_checkpoint: Callable[[int, str], None] | None,
         should_stop: Callable[[], bool] | None) -> ScenarioResult:
    t0 = time.perf_counter()
    model = _warm_started(config)
    behaviour, older = make_policy(config), make_policy(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, betas=config.adam_betas)
    gen = torch.Generator().manual_seed(config.seed)
    heldout_set = make_prompts(config.heldout_prompts // 2, config, torch.Generator().manual_seed(12345), heldout=True)
    versions: dict[int, dict[str, torch.Tensor]] = {0: _snapshot(model)}
    result = ScenarioResult(config=config)
    names = TASK_SETS[config.tasks]

    for step in range(config.steps):
        trainer_version = step
        for group in optimizer.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / max(1, config.warmup_steps))
        started = time.perf_counter()
        rollout = _rollout(config, step, versions, behaviour, older, gen)
        generated = time.perf_counter()
        with torch.no_grad():
            trainer_logp, entropy = token_logp_entropy(model, rollout.task["prompts"], rollout.out["responses"],
                                                       config.trainer_temperature)
        mask = rollout.out["mask"]
        trainer_logp = trainer_logp.masked_fill(~mask, 0.0)
        entropy = entropy.masked_fill(~mask, 0.0)
        token_version = torch.where(rollout.out["from_old"], rollout.v_old, rollout.v_new).long().masked_fill(~mask, 0)
        fields = _observed_fields(config, step, rollout, trainer_logp, entropy, token_version, names)
        advantages = group_advantages(rollout.rewards, config.group_size)
        weights = behaviour_weights(trainer_logp, rollout.out["logp"], mask, config)
        scored = time.perf_counter()
        stats = ppo_update(model, optimizer, rollout.batch, advantages, weights, trainer_logp, config, gen)
        trained = time.perf_counter()
        versions[trainer_version + 1] = _snapshot(model)
        # The demo's own timings: its weight sync is the snapshot of the new weights and the sampler's load.
        fields["phases"] = {"generation": generated - started - rollout.sync_seconds, "old_logp": scored - generated,
                            "training": trained - scored,
                            "sync": time.perf_counter() - trained + rollout.sync_seconds}
        for v in [v for v in versions if v < trainer_version + 1 - config.lag - 1 and v != config.sync_stops_at]:
            del versions[v]

        metrics = _step_metrics(step, rollout, trainer_logp, entropy, token_version, stats, names)
        if step % config.eval_every == 0 or step == config.steps - 1:
            score = evaluate(model, heldout_set, config)
            metrics["heldout_true_reward"] = score
            result.heldout.append((step, score))
        result.history.append(metrics)
        if on_step is not None:
            on_step(StepInfo(step=step, fields=fields, metrics=metrics,
                             episodes=_episodes(rollout.batch, rollout.rewards, rollout.true_pass, names)))
        if checkpoint_dir is not None and (step + 1) % checkpoint_every == 0:
            path = _save_checkpoint(model, config, step, trainer_version + 1, checkpoint_dir)
            if on_checkpoint is not None:
                on_checkpoint(step, path)
        if should_stop is not None and should_stop():
            break
    result.seconds = time.perf_counter() - t0
    return result


@dataclass
class _Rollout:
    """One step's sampled and graded episodes: ``task`` (the prompts, each repeated ``group_size``
    times), ``out`` (what :func:`sample` returned), ``batch`` (both), per-episode ``rewards`` and
    ``true_pass`` [B], ``failed`` [B] (None when no failure is injected), and the versions that
    sampled: ``v_new``, and ``v_old`` for the first part of a partial rollout."""

    task: dict[str, torch.Tensor]
    out: dict[str, torch.Tensor]
    batch: dict[str, torch.Tensor]
    rewards: torch.Tensor
    true_pass: torch.Tensor
    failed: torch.Tensor | None
    v_new: int
    v_old: int
    sampler_temp: float
    sync_seconds: float = 0.0          # loading the sampler's weights (part of the weight sync)


def _rollout(config: ScenarioConfig, step: int, versions: dict[int, dict[str, torch.Tensor]], behaviour: Policy,
             older: Policy, gen: torch.Generator) -> _Rollout:
    """Sample the step's groups with the policy ``config.lag`` versions old (spliced with the one
    before it for partial rollouts), grade them, and fail a share of them when configured."""
    g, trainer_version = config.group_size, step
    sampler_temp = config.sampler_temperature or config.trainer_temperature
    every, start = config.intermittent_every, config.intermittent_from
    if every and step >= start and (step - start) % every == 0:
        sampler_temp = config.intermittent_temperature
    lag = int(torch.randint(0, config.lag + 1, (1,), generator=gen)) if config.lag_jitter else config.lag
    v_new = max(0, trainer_version - lag)
    if config.sync_stops_at is not None:
        v_new = min(v_new, config.sync_stops_at)
    loading = time.perf_counter()
    behaviour.load_state_dict(versions[v_new])
    sync_seconds = time.perf_counter() - loading
    task = make_prompts(config.prompts_per_step // 2, config, gen)
    task = {k: v.repeat_interleave(g, dim=0) for k, v in task.items()}
    b = task["prompts"].shape[0]
    old, switch, v_old = None, None, v_new
    if config.partial_rollouts:
        v_old = max(0, v_new - 1)
        loading = time.perf_counter()
        older.load_state_dict(versions[v_old])
        sync_seconds += time.perf_counter() - loading
        old = older
        is_partial = torch.rand(b, generator=gen) < config.partial_fraction
        cut = torch.randint(1, config.max_digits + 1, (b,), generator=gen)
        switch = torch.where(is_partial, cut, 0)
    out = sample(behaviour, task["prompts"], config.max_response, gen, sampler_temp, config.sampler_top_p,
                 old=old, switch=switch, precision=config.sampler_precision)
    rewards, true_pass = grade(out["responses"], out["truncated"], task["targets"], task["target_len"],
                               task["env"], config.hack, config.partial_credit)
    failed = None
    if config.failure_rate > 0 and step >= config.failure_from:
        failed = torch.rand(b, generator=gen) < config.failure_rate
        rewards = rewards.masked_fill(failed, 0.0)
        true_pass = true_pass & ~failed
    return _Rollout(task, out, {**task, **out}, rewards, true_pass, failed, v_new, v_old, sampler_temp, sync_seconds)


def _observed_fields(config: ScenarioConfig, step: int, rollout: _Rollout, trainer_logp: torch.Tensor,
                     entropy: torch.Tensor, token_version: torch.Tensor, names: tuple[str, ...]) -> dict:
    """``observe(step, **fields)``'s keywords for the step: what a trainer hands rlwatch."""
    out, b, g = rollout.out, rollout.task["prompts"].shape[0], config.group_size
    fields = {
        "mask": out["mask"], "sampler_logp": out["logp"], "trainer_logp": trainer_logp,
        "token_version": token_version, "trainer_version": step, "rewards": rollout.rewards,
        "group_ids": torch.arange(b, dtype=torch.long) // g + step * (b // g),
        "truncated": out["truncated"].clone(), "env": [names[e] for e in rollout.task["env"].tolist()],
        "entropy": entropy, "temperature": float(rollout.sampler_temp),
        "top_p": float(config.sampler_top_p if config.sampler_top_p is not None else 1.0),
        "durations": out["seconds"], "dropped_reasons": [],      # real decode times; nothing launched is dropped
    }
    if rollout.failed is not None:
        fields["failed"] = ["timeout" if f else None for f in rollout.failed.tolist()]
    return fields


def _step_metrics(step: int, rollout: _Rollout, trainer_logp: torch.Tensor, entropy: torch.Tensor,
                  token_version: torch.Tensor, stats: dict, names: tuple[str, ...]) -> dict:
    """The step's own metrics (what a trainer would log), per environment for hacks and true passes."""
    out, rewards, true_pass = rollout.out, rollout.rewards, rollout.true_pass
    m = out["mask"].float()
    n_tok = m.sum().clamp(min=1.0)
    hacked = (rewards >= 0.999) & ~true_pass
    metrics = {
        "step": step, "train_reward": rewards.mean().item(), "train_true_pass": true_pass.float().mean().item(),
        "entropy": ((entropy * m).sum() / n_tok).item(),
        "mismatch": (((trainer_logp - out["logp"]).abs() * m).sum() / n_tok).item(),
        "mean_lag": (((step - token_version) * m).sum() / n_tok).item(),
        "response_length": m.sum(1).mean().item(), "truncated_frac": out["truncated"].float().mean().item(),
        **stats,
    }
    for i, name in enumerate(names):
        rows = rollout.task["env"] == i
        metrics[f"hacked_frac/{name}"] = hacked[rows].float().mean().item()
        metrics[f"true_pass/{name}"] = true_pass[rows].float().mean().item()
    return metrics


def scenario(name: str, **overrides) -> ScenarioConfig:
    """A copy of ``SCENARIOS[name]`` with fields replaced."""
    return replace(SCENARIOS[name], **overrides)
