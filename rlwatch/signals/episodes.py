"""The per-episode signals as one pure tensor function, shaped for ``torch.compile`` like
:func:`rlwatch.signals.fused.token_core`: rewards, zero-variance GRPO groups by kind, response
lengths, truncation and the per-environment sums, packed in one float64 vector whose layout
:func:`episode_layout` describes and whose host formulas :func:`finish_episodes` applies.

No host synchronisation, no data-dependent shape, no Python branch on tensor values, and no float
atomics: per-group counts are one int64 scatter-add over offset slots, a group's constancy is
tested against one of its own rewards (written by a plain scatter, so whichever write wins gives the
same answer), and every per-environment sum is a reduction of the product with the one-hot [E, B]
environment matrix (integer counts are exact in float64), deterministic on every device.

Shapes: B episodes; ``ok`` [B] bool (episodes that did not fail for an infrastructure reason);
``rewards`` [B] float; ``group_ids`` [B] int64; ``env_index`` [B] int64 into E environments, with
``env_slots`` any tensor of E' >= E elements (its shape is the row count of the sums, so that one
compiled function serves every E up to E'); ``truncated`` [B] bool; ``hacked`` [D, B] bool;
``bounds`` float64 [3] = (fail reward, pass reward, 1 when configured else 0).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..metrics import ZERO_VARIANCE_KINDS
from .pending import Values, _div


def episode_layout(rewards: bool, groups: bool, envs: int, env_columns: int, truncated: bool) -> dict[str, Any]:
    """Positions in :func:`episode_core`'s output (``envs`` = E', the rows of the env sums)."""
    at, pos = 0, {}

    def take(name: str, size: int) -> None:
        nonlocal at
        pos[name], at = slice(at, at + size), at + size
    if rewards:
        take("rewards", 4)                 # non-finite rewards, n, sum r, sum r^2
        if groups:
            take("groups", 8)              # groups, pass, fail, constant, zero-var episodes, n, size min, max
    take("lengths", 3)                     # mean, max, p99
    if truncated:
        take("truncated", 1)
    if envs:
        take("env_sums", envs * env_columns)
        if rewards and groups:
            take("env_groups", envs * 2)
    pos["size"] = at
    return pos


def env_columns(rewards: bool, truncated: bool, detectors: list[str]) -> list[str]:
    """Names of the per-environment sums, in :func:`episode_core`'s column order."""
    names = ["episodes"]
    if rewards:
        names += ["ok", "r", "n", "rr", "nn", "rn"]
    if truncated:
        names.append("truncated")
    return names + ["hacked/" + d for d in detectors]


def episode_core(per_seq: torch.Tensor, ok: torch.Tensor, rewards: torch.Tensor | None,
                 group_ids: torch.Tensor | None, env_index: torch.Tensor | None, env_slots: torch.Tensor | None,
                 truncated: torch.Tensor | None, hacked: torch.Tensor | None, bounds: torch.Tensor,
                 qs: torch.Tensor) -> torch.Tensor:
    """Every per-episode sum of one step, packed as :func:`episode_layout` says (float64).

    per_seq: [B] response lengths (tokens); qs: float64 (0.5, 0.99), the last used for the length p99.
    """
    B = per_seq.shape[0]
    device = per_seq.device
    lengths = per_seq.double()
    okf = ok.double()
    parts: list[torch.Tensor] = []
    zero_var = index = None
    ok_r = ok
    r = okf
    if rewards is not None:
        # A NaN or infinite reward is counted and its episode left out of every reward signal.
        finite = torch.isfinite(rewards)
        ok_r = ok & finite
        okf = ok_r.double()
        r = torch.where(ok_r, rewards.double(), 0.0)
        parts.append(torch.stack([(ok & ~finite).double(), okf, r, r * r]).sum(1))   # r is 0 where not ok_r
        if group_ids is not None:
            index = _group_index(group_ids)
            zero_var, group_part = _groups(r, ok_r, index, bounds)
            parts.append(group_part)
    parts.append(_length_stats(lengths, qs[-1]))
    if truncated is not None:
        parts.append(truncated.double().mean().reshape(1))
    if env_index is not None and env_slots is not None:
        slots = torch.arange(env_slots.shape[0], device=device)
        one_hot = (env_index.unsqueeze(0) == slots.unsqueeze(1)).double()         # [E', B]
        columns = [torch.ones_like(okf)]
        if rewards is not None:
            n = lengths * okf
            columns += [okf, r, n, r * r, n * n, r * n]
        if truncated is not None:
            columns.append(truncated.double())
        if hacked is not None:
            columns += list(hacked.double().unbind(0))
        parts.append(_per_env(one_hot, torch.stack(columns, 1)))                       # [E', C]
        if zero_var is not None and index is not None:
            # A group counts once for each environment among its episodes: distinct (group,
            # environment) pairs from one sort of group * E' + environment.
            E = env_slots.shape[0]
            pair = (index * E + env_index).sort().values
            first = torch.cat([pair.new_ones(1, dtype=torch.bool), pair[1:] != pair[:-1]])[:B]
            group_of, env_of = pair // E, pair % E
            counted = torch.stack([first, first & zero_var[group_of]], 1).double()     # [B, 2]
            env_hot = (env_of.unsqueeze(0) == slots.unsqueeze(1)).double()
            parts.append(_per_env(env_hot, counted))                                   # [E', 2]
    return torch.cat(parts)


def _length_stats(lengths: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[3] float64: mean, max and the ``q`` quantile (linear interpolation) of [B] response lengths;
    NaN for an empty batch (which the compiled function never sees)."""
    if lengths.shape[0] == 0:
        return torch.full((3,), torch.nan, dtype=torch.float64, device=lengths.device)
    top = (torch.ones_like(lengths).sum() - 1).clamp_min(0)
    rank = q * top
    lo = rank.floor()
    hi = (lo + 1).minimum(top)
    v = lengths.sort().values[torch.stack([lo, hi]).long()]               # a gather, not a read
    p99 = v[0] + (rank - lo) * (v[1] - v[0])
    return torch.stack([lengths.mean(), lengths.amax(), p99])


def _per_env(one_hot: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Row-major [E', C] sums of ``columns`` [B, C] per environment (``one_hot`` [E', B] float64), as a
    broadcast product and one sum: no BLAS call (whose first use on a host allocates its own
    buffers), fused into one kernel when compiled."""
    return (one_hot.unsqueeze(-1) * columns.unsqueeze(0)).sum(1).reshape(-1)


def _group_index(group_ids: torch.Tensor) -> torch.Tensor:
    """Group ids [B] compacted to 0..G-1 (by sorted id), without a host sync."""
    order = torch.argsort(group_ids, stable=True)
    g_sorted = group_ids[order]
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=group_ids.device),
                        (g_sorted[1:] != g_sorted[:-1]).long()])
    return torch.empty_like(order).scatter_(0, order, starts.cumsum(0))


def _groups(r: torch.Tensor, ok_r: torch.Tensor, index: torch.Tensor,
            bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-variance flags per group slot [B] bool, and the group sums [8] float64."""
    B = r.shape[0]
    # One reward of each group's usable episodes (the last write wins: any one of them will do).
    ref = r.new_zeros(B + 1).scatter_(0, torch.where(ok_r, index, B), r)[:B]
    differs = ok_r & (r != ref[index])
    # Group sizes and the episodes differing from their group's reference: one integer scatter-add.
    size, n_differ = torch.zeros(2 * B, dtype=torch.int64, device=r.device).scatter_add_(
        0, torch.cat([index, index + B]), torch.cat([ok_r, differs]).long()).view(2, B).unbind()
    exists = size > 0
    zero_var = exists & (n_differ == 0)
    # Classify constant groups by the configured (fail, pass) rewards, else the batch's range
    # (+inf, -inf without usable episodes); when the batch is one constant, by sign.
    if B:
        neg_lo, hi = torch.where(ok_r, torch.stack([-r, r]), -torch.inf).amax(1).unbind()
    else:
        neg_lo, hi = r.new_full((2,), -torch.inf).unbind()
    given = bounds[2] > 0
    lo = torch.where(given, bounds[0], -neg_lo)
    hi = torch.where(given, bounds[1], hi)
    spread = hi > lo
    at_pass = zero_var & torch.where(spread, ref >= hi, ref > 0)
    at_fail = zero_var & ~at_pass & torch.where(spread, ref <= lo, ref <= 0)
    # Groups, passing, failing and other constant groups, zero-variance episodes, usable episodes.
    sums = torch.stack([exists, at_pass, at_fail, zero_var & ~at_pass & ~at_fail, zero_var[index] & ok_r,
                        ok_r]).sum(1)
    sizes = size.double()
    if B == 0:
        extremes = torch.full((2,), torch.nan, dtype=torch.float64, device=r.device)
    else:
        extremes = torch.stack([torch.where(exists, sizes, torch.inf).amin(), sizes.amax()])
    return zero_var, torch.cat([sums, extremes])


def finish_episodes(v: list[float], pos: dict[str, Any], envs: list[str], columns: list[str],
                    detectors: list[str]) -> Values:
    """The host formulas of the episode signals from :func:`episode_core`'s vector ``v``."""
    from .environments import _finish_envs
    from .groups import _std

    out: Values = {}
    if "rewards" in pos:
        nonfinite, n, s, sq = v[pos["rewards"]]
        out["nonfinite_rewards"] = {(): nonfinite}
        out["nonfinite_rewards_total"] = {(): nonfinite}
        out["reward_mean"] = {(): _div(s, n)}
        out["reward_std"] = {(): _std([n, s, sq])}
    if "groups" in pos:
        groups, *kinds, zero_eps, n, size_min, size_max = v[pos["groups"]]
        out["groups"] = {(): groups}
        out["groups_total"] = {(): groups}
        out["zero_variance_groups_ratio"] = {(k,): _div(c, groups) for k, c in zip(ZERO_VARIANCE_KINDS, kinds)}
        out["zero_variance_groups_total"] = {(k,): c for k, c in zip(ZERO_VARIANCE_KINDS, kinds)}
        out["zero_gradient_episodes_ratio"] = {(): _div(zero_eps, n)}
        out["_group_size_min"] = {(): size_min}
        out["_group_size_max"] = {(): size_max}
    mean, longest, p99 = v[pos["lengths"]]
    out["response_length_mean"] = {(): mean}
    out["response_length_max"] = {(): longest}
    out["response_length_p99"] = {(): p99}
    if "truncated" in pos:
        out["truncated_ratio"] = {(): v[pos["truncated"]][0]}
    if "env_sums" in pos:
        C, E = len(columns), len(envs)
        sums = v[pos["env_sums"]][:E * C]
        zero = v[pos["env_groups"]][:E * 2] if "env_groups" in pos else None
        out.update(_finish_envs(sums, zero, columns, envs, detectors))
    return {name: {k: (x if x is not None and math.isfinite(x) else None) for k, x in rows.items()}
            for name, rows in out.items()}
