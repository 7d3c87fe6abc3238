"""Episode-level signals: GRPO groups (zero variance), rewards, response lengths, entropy."""

from __future__ import annotations

import math
import operator

import torch

from ..metrics import ZERO_VARIANCE_KINDS
from .pending import Pending, _div
from .reduce import _dot, _nonfinite_indicator, _sorted_quantile
from .settings import SignalConfig

def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact group ids [B] into 0..G-1 without a host sync. Returns (index [B], group_exists [B])
    where group_exists marks which of the B slots hold a group."""
    B = group_ids.numel()
    order = torch.argsort(group_ids, stable=True)
    g_sorted = group_ids[order]
    starts = torch.ones(B, dtype=torch.int64, device=group_ids.device)
    if B > 1:
        torch.ne(g_sorted[1:], g_sorted[:-1], out=starts[1:])
    idx_sorted = starts.cumsum_(0).sub_(1)
    index = torch.empty_like(idx_sorted).scatter_(0, order, idx_sorted)
    exists = torch.arange(B, device=group_ids.device) <= idx_sorted[-1:] if B else starts.bool()
    return index, exists


def group_signals(out: Pending, rewards: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor],
                  ok: torch.Tensor, config: SignalConfig) -> torch.Tensor:
    """Zero-variance GRPO groups. rewards [B] float, groups: :func:`group_index` of the group ids,
    ok [B] bool (episodes that did not fail for an infrastructure reason). Returns the zero-variance
    flag per group slot [B] bool (over the group's episodes that did not fail)."""
    B = rewards.numel()
    index = groups[0]
    rewards = rewards.to(torch.float64)
    okf = ok.to(torch.float64)
    size = torch.zeros(B, dtype=torch.float64, device=rewards.device).index_add_(0, index, okf)
    # (r, -r) of the episodes that did not fail, +inf elsewhere: one scatter-min gives each group's
    # minimum and -maximum, one min over the batch the bounds.
    signed = torch.where(ok.unsqueeze(1), torch.stack([rewards, -rewards], 1), torch.inf)     # [B, 2]
    extremes = torch.full_like(signed, torch.inf).scatter_reduce_(0, index.unsqueeze(1).expand(B, 2), signed, "amin")
    rmin, rmax = extremes[:, 0], -extremes[:, 1]
    exists = size > 0
    zero_var = exists & (rmax == rmin)
    # When the whole batch is one constant, classify by sign: positive passes, otherwise fails.
    # Configured bounds are chosen on the host; inferred ones on the device, without a sync.
    if config.reward_bounds is not None or not B:
        lo, hi = (float(v) for v in config.reward_bounds or (0.0, 0.0))
        at_pass, at_fail = ((rmin >= hi), (rmax <= lo)) if hi > lo else ((rmin > 0), (rmax <= 0))
    else:
        bounds = signed.amin(0)
        lo, hi = bounds[0], -bounds[1]
        spread = hi > lo
        at_pass, at_fail = torch.where(spread, rmin >= hi, rmin > 0), torch.where(spread, rmax <= lo, rmax <= 0)
    passes = zero_var & at_pass
    fails = zero_var & ~passes & at_fail
    constant = zero_var & ~passes & ~fails
    episode_zero_var = zero_var[index] * okf
    # groups, the three kinds of constant groups, zero-variance episodes, episodes: one product.
    sums = torch.mv(torch.stack([exists, passes, fails, constant, episode_zero_var, okf]).to(torch.float64),
                    torch.ones(B, dtype=torch.float64, device=rewards.device))
    out.derive("groups", operator.itemgetter(0), sums)
    out.derive("groups_total", operator.itemgetter(0), sums)
    for i, kind in enumerate(ZERO_VARIANCE_KINDS, start=1):
        out.derive("zero_variance_groups_ratio", lambda sums, i=i: _div(sums[i], sums[0]), sums, labels=(kind,))
        out.derive("zero_variance_groups_total", operator.itemgetter(i), sums, labels=(kind,))
    out.derive("zero_gradient_episodes_ratio", lambda sums: _div(sums[4], sums[5]), sums)
    out.put("_group_size_min", torch.where(exists, size, torch.inf).amin() if B else torch.tensor(float("nan")))
    out.put("_group_size_max", size.amax() if B else torch.tensor(float("nan")))
    return zero_var


def length_signals(out: Pending, mask: torch.Tensor, truncated: torch.Tensor | None,
                   lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Response lengths (tokens, from the mask) and the truncated fraction. mask [B, T] float.
    Returns the lengths [B]."""
    lengths = (mask.sum(-1) if lengths is None else lengths).double()         # [B]
    B = lengths.numel()
    out.put("response_length_mean", lengths.mean() if B else torch.tensor(float("nan")))
    out.put("response_length_max", lengths.amax() if B else torch.tensor(float("nan")))
    out.put("response_length_p99", _sorted_quantile(lengths, 0.99))
    if truncated is not None:
        out.put("truncated_ratio", truncated.double().mean() if B else torch.tensor(float("nan")))
    return lengths


def reward_signals(out: Pending, rewards: torch.Tensor, ok: torch.Tensor) -> None:
    """Episode reward mean and std over episodes that did not fail. rewards [B], ok [B] bool."""
    okf = ok.double()
    r = torch.where(ok, rewards.double(), 0.0)               # a failed episode's reward may be NaN
    moments = torch.mv(torch.stack([okf, r, r * r]), okf)                    # n, sum r, sum r^2
    out.derive("reward_mean", lambda m: _div(m[1], m[0]), moments)
    out.derive("reward_std", _std, moments)


def _std(moments: list[float]) -> float | None:
    """Population standard deviation from [n, sum x, sum x^2]."""
    n, s, sq = moments
    return math.sqrt(max(sq / n - (s / n) ** 2, 0.0)) if n else None


def entropy_signal(out: Pending, entropy: torch.Tensor, mask: torch.Tensor) -> None:
    """Mean per-token entropy over masked tokens with a finite entropy. entropy, mask: [B, T]."""
    e = entropy.to(torch.float32)
    good = mask * (1.0 - _nonfinite_indicator(e))
    out.ratio("entropy_mean", _dot(e.nan_to_num(0.0, 0.0, 0.0), good), good.sum())

