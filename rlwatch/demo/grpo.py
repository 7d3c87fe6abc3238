"""The demo's GRPO step: group advantages, behaviour weights, the PPO-clipped update, the supervised
warm start and the held-out evaluation.

Shapes as in :mod:`rlwatch.demo.scenario`; log-probs in nats.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ScenarioConfig
from .policy import Policy, sample
from .tasks import DIGITS, EOS, PAD, grade, make_prompts

def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO advantages: rewards [B] (groups contiguous) -> (r - group mean) / (group std + 1e-6), [B]."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)


def behaviour_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                      config: ScenarioConfig) -> torch.Tensor:
    """Detached per-token weights [B, T]: the mask ('none'), min(pi_old/mu, C) ('tis') or
    pi_old/mu inside [low, high] and 0 outside ('mis'); 0 off the mask."""
    m = mask.float()
    if config.correction == "none":
        return m
    log_ratio = (trainer_logp - sampler_logp).detach().clamp(-20.0, 20.0)
    if config.correction == "tis":
        return log_ratio.clamp(max=math.log(config.tis_cap)).exp() * m
    low, high = config.mis_band
    ratio = log_ratio.exp()
    return ratio * ((ratio >= low) & (ratio <= high)) * m


def token_logp_entropy(model: Policy, prompts: torch.Tensor, responses: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-prob of each response token and the entropy of its distribution: [B, T] each."""
    logp_all = torch.log_softmax(model.response_logits(prompts, responses) / temperature, dim=-1)
    logp = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def ppo_update(model: Policy, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
               advantages: torch.Tensor, weights: torch.Tensor, old_logp: torch.Tensor,
               config: ScenarioConfig, gen: torch.Generator) -> dict[str, float]:
    """Decoupled PPO-clip epochs over minibatches; per-token advantages are ``A * w``.

    advantages [B], weights [B, T] and old_logp [B, T] are constants. Returns mean loss and clip
    fraction over the minibatches.
    """
    prompts, responses, mask = batch["prompts"], batch["responses"], batch["mask"].float()
    adv = advantages[:, None] * weights
    losses, clips = [], []
    for _ in range(config.epochs):
        for rows in torch.randperm(len(prompts), generator=gen).chunk(config.minibatches):
            logp, _ = token_logp_entropy(model, prompts[rows], responses[rows], config.trainer_temperature)
            ratio = (logp - old_logp[rows]).exp()
            clipped = ratio.clamp(1 - config.clip_eps, 1 + config.clip_eps)
            m = mask[rows]
            per_token = -torch.minimum(ratio * adv[rows], clipped * adv[rows])
            loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            losses.append(loss.detach())
            clips.append((((ratio - 1).abs() > config.clip_eps).float() * m).sum() / m.sum().clamp(min=1.0))
    return {"loss": torch.stack(losses).mean().item(), "clip_frac": torch.stack(clips).mean().item()}


def pretrain(model: Policy, config: ScenarioConfig, gen: torch.Generator) -> None:
    """Supervised warm start: ``pretrain_steps`` Adam steps of cross-entropy on correct answers
    (both environments, batches of ``prompts_per_step * group_size``), leaving a partly competent
    base policy for RL to improve."""
    if config.pretrain_steps <= 0:
        return
    optimizer = torch.optim.Adam(model.parameters(), lr=config.pretrain_lr)
    n = config.prompts_per_step * config.group_size
    for _ in range(config.pretrain_steps):
        task = make_prompts(n // 2, config, gen)
        responses = torch.full((n, config.max_response), PAD, dtype=torch.long)
        noisy = torch.rand(task["targets"].shape, generator=gen) < config.pretrain_noise
        random_digits = torch.randint(0, DIGITS, task["targets"].shape, generator=gen)
        responses[:, :config.max_digits] = torch.where(noisy & (task["targets"] != PAD), random_digits, task["targets"])
        extra = torch.rand(n, generator=gen) < config.pretrain_extra
        answer_len = task["target_len"] + extra.long()
        responses.scatter_(1, task["target_len"][:, None], torch.randint(0, DIGITS, (n, 1), generator=gen))
        responses.scatter_(1, answer_len[:, None], EOS)
        mask = (torch.arange(config.max_response) <= answer_len[:, None]).float()
        logits = model.response_logits(task["prompts"], responses)
        loss = (F.cross_entropy(logits.transpose(1, 2), responses, reduction="none") * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@torch.no_grad()
def evaluate(model: Policy, heldout: dict[str, torch.Tensor], config: ScenarioConfig) -> float:
    """Held-out TRUE reward: exact-match rate on the fixed held-out prompts (greedy, or sampled with a
    fixed generator so that two evaluations of the same weights agree)."""
    out = sample(model, heldout["prompts"], config.max_response, torch.Generator().manual_seed(4321),
                 greedy=config.eval_greedy, temperature=config.trainer_temperature)
    _, true_pass = grade(out["responses"], out["truncated"], heldout["targets"], heldout["target_len"],
                         heldout["env"], hack=False)
    return true_pass.float().mean().item()
