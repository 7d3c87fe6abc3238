"""A tiny, real GRPO training in pure torch that reproduces the stale-policy story on demand.

A GRU policy (about 25k parameters, 15-token vocabulary) answers digit-string prompts in two
environments: ``copy`` (answer the prompt's digits, then EOS) and ``reverse`` (answer them reversed).
It starts from a short supervised warm start on imperfect demonstrations (a share of the digits is
wrong and 60% of the answers carry one extra digit, so the base policy answers too long), then
trains by GRPO: ``group_size`` samples per prompt, group-normalised advantages of a 0/1 exact-match
reward, PPO-clipped ratio ``pi_theta / pi_old`` with ``pi_old`` recomputed by the trainer, Adam,
``epochs x minibatches`` updates per step. The behaviour policy ``mu`` that samples is the policy
``lag`` updates old; the decoupled loss multiplies the advantages by a behaviour weight
``w = pi_old / mu`` (``correction``: "none" -> 1, "tis" -> min(w, C), "mis" -> w inside a band, 0 out).

Why the stories happen (measured by ``python -m rlwatch.demo.calibrate``):

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
:func:`_apply_heldout_rule`), answered by the current policy with a fixed sampling seed, scored by the
true checker. Runs are deterministic for a given seed and thread count (``threads``, default 1; a
different thread count changes float rounding and therefore the trajectory).

Conventions: ``B`` episodes per step (``prompts_per_step * group_size``), ``P`` prompt length
(left-padded), ``T`` = ``max_response`` response positions, ``V`` vocabulary size. Log-probs are in
nats.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# --- vocabulary -------------------------------------------------------------------------------

DIGITS = 10
EOS, SEP, PAD = 10, 11, 12
ENV_NAMES = ("copy", "reverse")
ENV_TOKEN = {"copy": 13, "reverse": 14}
VOCAB = 15
#: Task sets: the two environments' names (the second one's grader carries the ``hack`` bug). The
#: token of the first environment is 13, of the second 14, whatever the set.
TASK_SETS: dict[str, tuple[str, str]] = {"copy-reverse": ("copy", "reverse"), "sort-shift": ("sort", "shift")}


@dataclass
class ScenarioConfig:
    """One training run. Defaults are the calibrated "healthy" run.

    lag: behaviour-policy staleness in updates (the sampler uses version ``max(0, v - lag)``).
    correction: "none" | "tis" | "mis" (behaviour weights ``w = pi_old / mu``).
    sampler_temperature / sampler_top_p: what the sampler samples and reports at, when it differs
        from the trainer (a semantics fault). None means "same as the trainer".
    partial_rollouts: a fraction of the sequences start with a version one older than the
        sampler's and switch to the sampler's version mid-sequence.
    hack: the ``reverse`` grader has a bug (any prefix of the target, the empty answer included,
        gets reward 1); the true checker is unchanged.
    policy: "gru" (the default family) or "transformer" (a two-layer causal transformer).
    tasks: a key of ``TASK_SETS``: "copy-reverse" (the default) or "sort-shift" (answer the digits
        sorted ascending / each digit plus one modulo 10).
    failure_rate / failure_from: from step ``failure_from`` on, this share of episodes fails for an
        infrastructure reason (reported as ``failed="timeout"``, scored 0 as many pipelines do).
    """

    seed: int = 0
    steps: int = 100
    lag: int = 0
    correction: str = "none"
    tis_cap: float = 2.0
    mis_band: tuple[float, float] = (0.5, 5.0)
    sampler_temperature: float | None = None
    sampler_top_p: float | None = None
    partial_rollouts: bool = False
    hack: bool = False
    policy: str = "gru"
    tasks: str = "copy-reverse"
    failure_rate: float = 0.0
    failure_from: int = 0
    # training
    trainer_temperature: float = 1.0
    lr: float = 6e-3
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 5         # linear lr warm-up over the first RL steps (a fresh Adam's first steps are sign-like)
    prompts_per_step: int = 32
    group_size: int = 8
    epochs: int = 2
    minibatches: int = 4
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    partial_credit: bool = False  # training reward = share of positions right (else exact match only)
    pretrain_steps: int = 150     # supervised warm start on correct answers before RL
    pretrain_lr: float = 3e-3
    pretrain_noise: float = 0.2   # probability that a demonstration digit is replaced by a random digit
    pretrain_extra: float = 0.6   # probability that a demonstration has one extra random digit before EOS
    # task and model
    min_digits: int = 1
    max_digits: int = 2
    length_weights: tuple[float, ...] = (0.1, 0.9)   # relative frequency of lengths min_digits..max_digits (uniform if empty)
    max_response: int = 6
    embed_dim: int = 32
    hidden_dim: int = 64
    partial_fraction: float = 0.5
    # evaluation
    heldout_prompts: int = 128
    eval_greedy: bool = False     # held-out answers greedy, else sampled at the trainer temperature (fixed seed)
    eval_every: int = 1
    threads: int = 1              # torch intra-op threads during the run (0: leave as is); results depend on it

    def __post_init__(self) -> None:
        if self.correction not in ("none", "tis", "mis"):
            raise ValueError(f"correction must be 'none', 'tis' or 'mis', got {self.correction!r}")
        if self.lag < 0:
            raise ValueError(f"lag must be >= 0, got {self.lag}")
        if self.policy not in ("gru", "transformer"):
            raise ValueError(f"policy must be 'gru' or 'transformer', got {self.policy!r}")
        if self.tasks not in TASK_SETS:
            raise ValueError(f"tasks must be one of {', '.join(TASK_SETS)}, got {self.tasks!r}")
        if self.max_response < self.max_digits + 1:
            raise ValueError("max_response must leave room for the longest answer and EOS")


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


# --- policy -----------------------------------------------------------------------------------

class Policy(nn.Module):
    """Embedding -> one-layer GRU -> linear head over ``VOCAB`` tokens."""

    def __init__(self, embed_dim: int = 32, hidden_dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed_dim)
        self.gru = nn.GRU(embed_dim, hidden_dim, batch_first=True)
        self.head = nn.Linear(hidden_dim, VOCAB)

    def encode(self, ids: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, L] int64 -> (hidden states [B, L, H], last state [1, B, H])."""
        return self.gru(self.embed(ids), h)

    def response_logits(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of each response token: [B, P], [B, T] -> [B, T, V]."""
        ids = torch.cat([prompts, responses[:, :-1]], dim=1)
        out, _ = self.encode(ids)
        return self.head(out[:, prompts.shape[1] - 1:])


class TransformerPolicy(nn.Module):
    """Embedding + learned positions -> two causal transformer layers -> linear head over ``VOCAB``.

    The same interface as :class:`Policy`: ``encode(ids, state)`` returns the hidden states of the
    new positions and a state, here the whole prefix of ids (sequences are a few tokens long, so
    each call re-encodes the prefix instead of keeping a key-value cache)."""

    MAX_LEN = 32

    def __init__(self, embed_dim: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed_dim)
        self.pos = nn.Embedding(self.MAX_LEN, embed_dim)
        layer = nn.TransformerEncoderLayer(embed_dim, heads, dim_feedforward=2 * embed_dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(embed_dim, VOCAB)

    def encode(self, ids: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, L] int64, h = earlier ids [B, L0] or None -> (hidden states [B, L, E], ids [B, L0 + L])."""
        full = ids if h is None else torch.cat([h, ids], dim=1)
        n = full.shape[1]
        x = self.embed(full) + self.pos(torch.arange(n))[None]
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        out = self.body(x, mask=causal)
        return out[:, n - ids.shape[1]:], full

    def response_logits(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of each response token: [B, P], [B, T] -> [B, T, V]."""
        ids = torch.cat([prompts, responses[:, :-1]], dim=1)
        out, _ = self.encode(ids)
        return self.head(out[:, prompts.shape[1] - 1:])


def make_policy(config: ScenarioConfig) -> nn.Module:
    if config.policy == "transformer":
        return TransformerPolicy(config.embed_dim)
    return Policy(config.embed_dim, config.hidden_dim)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- tasks ------------------------------------------------------------------------------------

_INV_MOD5 = torch.tensor([0, 1, 3, 2, 4])   # multiplicative inverses modulo 5


def _apply_heldout_rule(digits: torch.Tensor, lengths: torch.Tensor, heldout: bool) -> torch.Tensor:
    """Split strings of length >= 2 into training and held-out ones by the rule
    ``sum_i (i + 1) * d_i = 0 (mod 5)`` (one in five strings is held out).

    digits [N, K] (PAD beyond ``lengths``) -> digits [N, K] with the last digit changed where needed:
    training strings that satisfy the rule get their last digit incremented (which changes the sum
    by L != 0 mod 5); held-out strings get the last digit that satisfies it (keeping its parity
    class, so all ten digits occur). Strings of length 1 (only ten exist) are left as they are.
    """
    k = digits.shape[1]
    valid = torch.arange(k) < lengths[:, None]
    d = torch.where(valid, digits, 0)
    total = (d * torch.arange(1, k + 1)).sum(1)
    last_idx = (lengths - 1)[:, None]
    last = d.gather(1, last_idx).squeeze(1)
    ruled = (lengths >= 2) & (lengths % 5 != 0)
    if heldout:
        rest = total - lengths * last
        new_last = (_INV_MOD5[lengths % 5] * (-rest)) % 5 + 5 * (last % 2)
    else:
        new_last = torch.where(total % 5 == 0, (last + 1) % 10, last)
    new_last = torch.where(ruled, new_last, last)
    return digits.scatter(1, last_idx, new_last[:, None])


def make_prompts(n_per_env: int, config: ScenarioConfig, gen: torch.Generator,
                 heldout: bool = False) -> dict[str, torch.Tensor]:
    """Sample ``n_per_env`` digit strings per environment (training or held-out strings, see
    :func:`_apply_heldout_rule`).

    Returns ``prompts`` [N, P] (left-padded: PAD.., env token, digits, SEP), ``targets`` [N, K]
    (PAD beyond the answer), ``target_len`` [N] and ``env`` [N] (index into ``ENV_NAMES``), with
    N = 2 * n_per_env and environments alternating.
    """
    n, k = 2 * n_per_env, config.max_digits
    weights = torch.tensor(config.length_weights or [1.0] * (k + 1 - config.min_digits), dtype=torch.float)
    lengths = config.min_digits + torch.multinomial(weights, n, replacement=True, generator=gen)
    pos = torch.arange(k)
    valid = pos < lengths[:, None]
    digits = torch.where(valid, torch.randint(0, DIGITS, (n, k), generator=gen), PAD)
    digits = _apply_heldout_rule(digits, lengths, heldout)
    last = (lengths - 1)[:, None]
    env = torch.arange(n) % len(ENV_NAMES)
    # Prompt: right-aligned [env, digits..., SEP], left-padded to P = K + 2.
    width = k + 2
    shift_right = k - lengths                                       # [N] pad count
    cols = torch.arange(width)[None, :] - shift_right[:, None]     # column index into [env, d.., SEP]
    env_tok = torch.tensor([ENV_TOKEN[e] for e in ENV_NAMES])[env]
    body = torch.cat([env_tok[:, None], digits, torch.full((n, 1), PAD)], dim=1)    # [N, K + 2]
    body = body.scatter(1, (lengths + 1)[:, None], SEP)
    prompts = torch.where(cols >= 0, body.gather(1, cols.clamp(min=0)), PAD)
    rev_idx = (last - pos[None, :]).clamp(min=0)
    reversed_digits = torch.where(valid, digits.gather(1, rev_idx), PAD)
    if config.tasks == "sort-shift":
        first = digits.sort(dim=1).values                   # PAD (12) sorts after every digit
        second = torch.where(valid, (digits + 1) % DIGITS, PAD)
    else:
        first, second = digits, reversed_digits
    targets = torch.where((env == 1)[:, None], second, first)
    return {"prompts": prompts, "targets": targets, "target_len": lengths, "env": env}


def grade(responses: torch.Tensor, truncated: torch.Tensor, targets: torch.Tensor, target_len: torch.Tensor,
          env: torch.Tensor, hack: bool, partial_credit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Grade responses [B, T] (PAD after EOS) against targets [B, K] of lengths target_len [B].

    Returns (training reward [B] float32 in [0, 1], true pass [B] bool). The true checker is an
    exact match of the answer (the tokens before EOS; a truncated response fails). The training
    reward is the true verdict as 0/1, or with ``partial_credit`` the share of positions right,
    ``matches / max(len(answer), len(target))``. With ``hack`` the ``reverse`` grader compares only
    ``zip(answer, target)`` and therefore gives 1 to any prefix of the target, the empty answer
    included; ``env`` [B] holds indices into ``ENV_NAMES``.
    """
    k = targets.shape[1]
    is_eos = responses == EOS
    ans_len = torch.where(truncated, responses.shape[1], is_eos.float().argmax(1))
    pos = torch.arange(k)
    padded = F.pad(responses, (0, max(0, k - responses.shape[1])), value=PAD)[:, :k]
    hit = (padded == targets) & (pos < ans_len[:, None]) & (pos < target_len[:, None])
    matches = hit.sum(1)
    true_pass = (~truncated) & (ans_len == target_len) & (matches == target_len)
    reward = matches.float() / torch.maximum(ans_len, target_len).float()
    if not partial_credit:
        reward = true_pass.float()
    if hack:
        buggy = (env == 1) & (~truncated) & (matches == torch.minimum(ans_len, target_len))
        reward = torch.where(buggy & (ans_len <= target_len), torch.ones_like(reward), reward)
    return reward.float(), true_pass


# --- sampling ---------------------------------------------------------------------------------

def _sampler_logp(logits: torch.Tensor, temperature: float, top_p: float | None) -> torch.Tensor:
    """Log-probs the sampler draws from: logits [B, V] -> [B, V], -inf outside the top-p nucleus."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p is None or top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
    keep_sorted = mass_before < top_p                      # always keeps the top token
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = logp.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


@torch.no_grad()
def sample(new: Policy, prompts: torch.Tensor, max_len: int, gen: torch.Generator, temperature: float = 1.0,
           top_p: float | None = None, old: Policy | None = None, switch: torch.Tensor | None = None,
           greedy: bool = False) -> dict[str, torch.Tensor]:
    """Batched autoregressive sampling.

    prompts [B, P] -> ``responses`` [B, T] (PAD after EOS), ``logp`` [B, T] float32 (the sampler's
    log-prob of each sampled token under the distribution it sampled from), ``mask`` [B, T] bool
    (the EOS token included), ``truncated`` [B] bool, ``from_old`` [B, T] bool. When ``old`` is
    given, rows use ``old`` for positions ``t < switch[row]`` and ``new`` after (a partial rollout:
    both models read the same tokens, so ``new`` continues from a re-encoded prefix).
    """
    b = prompts.shape[0]
    models = [new] if old is None else [new, old]
    outs, states = zip(*(m.encode(prompts) for m in models))
    last = [o[:, -1] for o in outs]
    states = list(states)
    responses = torch.full((b, max_len), PAD, dtype=torch.long)
    logps = torch.zeros(b, max_len)
    mask = torch.zeros(b, max_len, dtype=torch.bool)
    from_old = torch.zeros(b, max_len, dtype=torch.bool)
    alive = torch.ones(b, dtype=torch.bool)
    for t in range(max_len):
        logits = new.head(last[0])
        if old is not None:
            use_old = t < switch
            logits = torch.where(use_old[:, None], old.head(last[1]), logits)
            from_old[:, t] = use_old & alive
        logp = _sampler_logp(logits, temperature, top_p)
        if greedy:
            tok = logp.argmax(-1)
        else:
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        mask[:, t] = alive
        logps[:, t] = torch.where(alive, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        tok = torch.where(alive, tok, PAD)
        responses[:, t] = tok
        alive = alive & (tok != EOS)
        if not alive.any():
            break
        for i, m in enumerate(models):
            o, states[i] = m.encode(tok[:, None], states[i])
            last[i] = o[:, -1]
    return {"responses": responses, "logp": logps, "mask": mask, "truncated": alive, "from_old": from_old}


# --- training ---------------------------------------------------------------------------------

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


def _run(config: ScenarioConfig, on_step: Callable[[StepInfo], None] | None, checkpoint_dir: str | None,
         checkpoint_every: int, on_checkpoint: Callable[[int, str], None] | None,
         should_stop: Callable[[], bool] | None) -> ScenarioResult:
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    model = make_policy(config)
    pretrain(model, config, torch.Generator().manual_seed(config.seed + 1_000_003))
    behaviour, older = make_policy(config), make_policy(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, betas=config.adam_betas)
    gen = torch.Generator().manual_seed(config.seed)
    heldout_set = make_prompts(config.heldout_prompts // 2, config, torch.Generator().manual_seed(12345), heldout=True)
    versions: dict[int, dict[str, torch.Tensor]] = {0: _snapshot(model)}
    sampler_temp = config.sampler_temperature or config.trainer_temperature
    result = ScenarioResult(config=config)
    g, n_per_env = config.group_size, config.prompts_per_step // 2
    names = TASK_SETS[config.tasks]

    for step in range(config.steps):
        trainer_version = step
        for group in optimizer.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / max(1, config.warmup_steps))
        v_new = max(0, trainer_version - config.lag)
        behaviour.load_state_dict(versions[v_new])
        task = make_prompts(n_per_env, config, gen)
        task = {k: v.repeat_interleave(g, dim=0) for k, v in task.items()}
        b = task["prompts"].shape[0]
        old, switch, v_old = None, None, v_new
        if config.partial_rollouts:
            v_old = max(0, v_new - 1)
            older.load_state_dict(versions[v_old])
            old = older
            is_partial = torch.rand(b, generator=gen) < config.partial_fraction
            cut = torch.randint(1, config.max_digits + 1, (b,), generator=gen)
            switch = torch.where(is_partial, cut, 0)
        out = sample(behaviour, task["prompts"], config.max_response, gen, sampler_temp, config.sampler_top_p,
                     old=old, switch=switch)
        batch = {**task, **out}
        rewards, true_pass = grade(out["responses"], out["truncated"], task["targets"], task["target_len"],
                                   task["env"], config.hack, config.partial_credit)
        failed = None
        if config.failure_rate > 0 and step >= config.failure_from:
            failed = torch.rand(b, generator=gen) < config.failure_rate
            rewards = rewards.masked_fill(failed, 0.0)
            true_pass = true_pass & ~failed
        mask = out["mask"]
        with torch.no_grad():
            trainer_logp, entropy = token_logp_entropy(model, task["prompts"], out["responses"],
                                                       config.trainer_temperature)
        trainer_logp = trainer_logp.masked_fill(~mask, 0.0)
        entropy = entropy.masked_fill(~mask, 0.0)
        token_version = torch.where(out["from_old"], v_old, v_new).long().masked_fill(~mask, 0)
        fields = {
            "mask": mask, "sampler_logp": out["logp"], "trainer_logp": trainer_logp,
            "token_version": token_version, "trainer_version": trainer_version, "rewards": rewards,
            "group_ids": torch.arange(b, dtype=torch.long) // g + step * (b // g),
            "truncated": out["truncated"].clone(), "env": [names[e] for e in task["env"].tolist()],
            "entropy": entropy, "temperature": float(sampler_temp),
            "top_p": float(config.sampler_top_p if config.sampler_top_p is not None else 1.0),
        }
        if failed is not None:
            fields["failed"] = ["timeout" if f else None for f in failed.tolist()]
        advantages = group_advantages(rewards, g)
        weights = behaviour_weights(trainer_logp, out["logp"], mask, config)
        stats = ppo_update(model, optimizer, batch, advantages, weights, trainer_logp, config, gen)
        versions[trainer_version + 1] = _snapshot(model)
        for v in [v for v in versions if v < trainer_version + 1 - config.lag - 1]:
            del versions[v]

        m = mask.float()
        n_tok = m.sum().clamp(min=1.0)
        hacked = (rewards >= 0.999) & ~true_pass
        metrics = {
            "step": step, "train_reward": rewards.mean().item(), "train_true_pass": true_pass.float().mean().item(),
            "entropy": ((entropy * m).sum() / n_tok).item(),
            "mismatch": (((trainer_logp - out["logp"]).abs() * m).sum() / n_tok).item(),
            "mean_lag": (((trainer_version - token_version) * m).sum() / n_tok).item(),
            "response_length": m.sum(1).mean().item(), "truncated_frac": out["truncated"].float().mean().item(),
            **stats,
        }
        for i, name in enumerate(names):
            rows = task["env"] == i
            metrics[f"hacked_frac/{name}"] = hacked[rows].float().mean().item()
            metrics[f"true_pass/{name}"] = true_pass[rows].float().mean().item()
        if step % config.eval_every == 0 or step == config.steps - 1:
            score = evaluate(model, heldout_set, config)
            metrics["heldout_true_reward"] = score
            result.heldout.append((step, score))
        result.history.append(metrics)
        if on_step is not None:
            on_step(StepInfo(step=step, fields=fields, episodes=_episodes(batch, rewards, true_pass, names), metrics=metrics))
        if checkpoint_dir is not None and (step + 1) % checkpoint_every == 0:
            path = _save_checkpoint(model, config, step, trainer_version + 1, checkpoint_dir)
            if on_checkpoint is not None:
                on_checkpoint(step, path)
        if should_stop is not None and should_stop():
            break
    result.seconds = time.perf_counter() - t0
    return result


def scenario(name: str, **overrides) -> ScenarioConfig:
    """A copy of ``SCENARIOS[name]`` with fields replaced."""
    return replace(SCENARIOS[name], **overrides)
