"""The per-episode signals as one pure tensor function, shaped for ``torch.compile`` like
:func:`rlwatch.signals.fused.token_core`, built from the declaration in :mod:`.quantities`
(:data:`~.quantities.EPISODE_ROWS`, :data:`~.quantities.GROUP_ROWS`): rewards, zero-variance GRPO
groups by kind, response lengths, truncation and the per-environment sums, packed in one float64
vector whose layout :func:`~.quantities.episode_layout` describes and whose host formulas
:func:`~.quantities.finish_episodes` applies.

Every per-episode quantity is a row of one [K, B] matrix, reduced once for the step's sums and once
for its maxima; the per-environment sums are one product of its first rows (the ``hacked`` rows and
those declared ``per_env``) with the one-hot [E', 1, B] environment matrix, reduced once. About 60 operations for a
step with rewards, groups, truncation and environments, whatever B.

Groups: one sort of the group ids, then each episode's *group slot* is the position of its id's
first occurrence in the sorted ids (one ``searchsorted``): equal ids share a slot, slots are in
[0, B). A group's constancy is tested against one of its own usable rewards (written by a plain
scatter, so whichever write wins gives the same answer); group sizes and the episodes differing from
that reward are integer counts (``bincount`` on CPU, an int64 scatter-add elsewhere). The group
block is :data:`~.quantities.GROUP_ROWS` over these per-slot tensors; eagerly its threshold rows are
one stacked comparison with the threshold vector, compiled one comparison each. A group counts
once for each environment among its episodes: the (group slot, environment) pairs are numbered and
the episode whose index a plain scatter leaves in a pair's cell is that pair's one representative
(again: any winner gives the same counts).

No host synchronisation, no data-dependent shape, no Python branch on tensor values and no float
atomics: every sum is a reduction, every count an integer, so the values are the same on every
device. A constant group is classified on the host: the device counts constant groups at or past
the batch's reward range, at or past the configured (fail, pass) rewards and above 0, and the host
picks the rule (:func:`~.quantities.finish_episodes`).

Shapes: B episodes; ``per_seq`` [B] response lengths (tokens, integers); ``ok`` [B] bool (episodes
that did not fail for an infrastructure reason); ``rewards`` [B] float64; ``group_ids`` [B] int64;
``env_index`` [B] int64 into E environments, with ``env_slots`` any tensor of E' >= E elements (its
shape is the row count of the per-environment sums, so that one compiled function serves every E up
to E'); ``truncated`` [B] bool; ``hacked`` [D, B] bool; ``bounds`` float64 [3] = :func:`bound_values`.
"""

from __future__ import annotations

import math

import torch

from . import quantities as q
from .reduce import cached, count_into, scalar
from .settings import compiling


def bound_values(reward_bounds: tuple[float, float] | None) -> tuple[float, float, float]:
    """The ``bounds`` input of :func:`episode_core`: (pass, -fail, the smallest positive float64),
    the last thresholds of :data:`~.quantities.GROUP_THRESHOLDS`."""
    fail, passing = (float(b) for b in reward_bounds or (0.0, 0.0))
    return passing, -fail, 5e-324


def episode_core(per_seq: torch.Tensor, ok: torch.Tensor, rewards: torch.Tensor | None,
                 group_ids: torch.Tensor | None, env_index: torch.Tensor | None, env_slots: torch.Tensor | None,
                 truncated: torch.Tensor | None, hacked: torch.Tensor | None, bounds: torch.Tensor) -> torch.Tensor:
    """Every per-episode sum of one step, packed as :func:`~.quantities.episode_layout` says (float64):
    the rows of :func:`~.quantities.episode_rows`, each from its declared term.

    per_seq: [B] response lengths (tokens); the length quantiles are
    :data:`~.quantities.LENGTH_QUANTILES`, interpolated on the host.
    """
    envs = env_index is not None and env_slots is not None
    groups = rewards is not None and group_ids is not None
    lengths = per_seq if per_seq.dtype == torch.float64 else per_seq.double()
    e: dict[str, torch.Tensor] = {"all_ok": ok, "length": lengths}
    if truncated is not None:
        e["truncated"] = truncated
    compiled = compiling()
    parts: list[torch.Tensor] = []
    group_rows: list[torch.Tensor] = []
    if rewards is not None:
        # A NaN or infinite reward is counted (all_ok - ok) and its episode left out of every reward signal.
        e["ok"] = ok & torch.eq(rewards - rewards, scalar(0.0, rewards))       # finite (isfinite costs more)
        e["r"] = torch.where(e["ok"], rewards, scalar(0.0, rewards))
        if groups:
            index = torch.searchsorted(group_ids.sort().values, group_ids)      # [B] group slots
            group_rows, reward_range, zero_var = _groups(e["r"], e["ok"], index, bounds, compiled)
            parts.append(reward_range)
            if envs:
                e.update(_pairs(index, env_index, env_slots.shape[0], zero_var))
    rows, termed, per_env = q.episode_rows(rewards is not None, groups, envs, truncated is not None)
    for row in termed:                          # in declaration order: a term may read an earlier row
        e[row.name] = row.term(e)
    width = per_env + (hacked.shape[0] if hacked is not None else 0)
    sums = _reduce([e[row.name] for row in rows[:len(termed)]], hacked, group_rows,
                   env_index if envs else None, env_slots.shape[0] if envs else 0, width, compiled)
    return torch.cat([*sums[:2], *parts, _length_order_statistics(lengths.sort().values), *sums[2:]])


def _reduce(main: list[torch.Tensor], hacked: torch.Tensor | None, group_rows: list[torch.Tensor],
            env_index: torch.Tensor | None, E: int, width: int, compiled: bool) -> list[torch.Tensor]:
    """The sums [K] and maxima [K] of the rows (``hacked`` [D, B], then ``main``, then ``group_rows``:
    [B] rows or [k, B] blocks), and with environments the [E', width] row-major sums of the first
    ``width`` rows per environment, all from one [K, B] float64 matrix.
    Eagerly the matrix is one stack and one cat. Compiled it is one chain of ``where`` over the row
    number: inductor lowers a CPU cat (and a GPU cat of more than 8 inputs) to one copy loop per
    input, while the chain is one elementwise loop (it evaluates every row at each element: a few
    dozen operations per element, nothing against a launch)."""
    if compiled:
        rows = (list(hacked.unbind()) if hacked is not None else []) + main + group_rows
        row = torch.arange(len(rows), device=rows[0].device).view(-1, 1)
        m = rows[-1].double().expand(len(rows), -1)
        for k in range(len(rows) - 2, -1, -1):
            m = torch.where(row == k, rows[k], m)
    else:
        matrix = ([hacked] if hacked is not None else []) + [torch.stack(main)] + group_rows
        m = torch.cat(matrix) if len(matrix) > 1 else matrix[0]
    B = m.shape[1]
    out = [m.sum(1), m.amax(1) if B else m.new_full((m.shape[0],), torch.nan)]
    if E:
        slots = cached(("env_slots", E, m.device), lambda: torch.arange(E, device=m.device).view(-1, 1, 1))
        block = m[:width] if width < m.shape[0] else m
        out.append(((env_index == slots) * block).sum(-1).reshape(-1))      # [E', width]
    return out


def _length_order_statistics(sorted_lengths: torch.Tensor) -> torch.Tensor:
    """[2 Q]: for each of the Q quantiles q of :data:`~.quantities.LENGTH_QUANTILES`, the order
    statistics lo and min(lo + 1, B - 1) of the sorted [B] lengths, lo = floor(q * (B - 1)); NaN for
    an empty batch (which compiled code never sees)."""
    B, Q = sorted_lengths.shape[0], len(q.LENGTH_QUANTILES)
    if compiling():                  # B is symbolic: the positions as a tensor
        device = sorted_lengths.device
        rank = torch.tensor(q.LENGTH_QUANTILES, dtype=torch.float64, device=device).repeat_interleave(2) * (B - 1)
        step = torch.arange(2, device=device).repeat(Q)
        return sorted_lengths[(rank.floor().long() + step).clamp_max(B - 1)]
    if B == 0:
        return torch.full((2 * Q,), torch.nan, dtype=torch.float64, device=sorted_lengths.device)
    if B == 1:
        return sorted_lengths.expand(2 * Q)
    los = [math.floor(quantile * (B - 1)) for quantile in q.LENGTH_QUANTILES]      # <= B - 2 (each q < 1)
    return torch.cat([sorted_lengths[lo:lo + 2] for lo in los])


def _groups(r: torch.Tensor, ok_r: torch.Tensor, index: torch.Tensor, bounds: torch.Tensor,
            compiled: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The rows of :func:`~.quantities.group_block` per group slot (one [k, B] matrix eagerly, k [B]
    rows compiled), the batch's reward range [2] (highest, -lowest usable reward; -inf without one)
    and the constant flags per slot [B + 1] bool."""
    B = r.shape[0]
    slot = torch.where(ok_r, index, B)                    # usable episodes; slot B collects the others
    # One usable reward of each group (a slot without one keeps whatever the buffer held: only
    # episodes that go to slot B read it, and only constant groups' values are used).
    ref = r.new_empty(B + 1).scatter_(0, slot, r)
    # Per slot: usable episodes + (B + 1) * those differing from the slot's reward, one integer sum.
    counts = count_into(B + 1, slot, torch.where(r != ref.gather(0, index), B + 2, 1))
    exists = counts > scalar(0, counts)
    zero_var = exists & (counts <= B)
    if B:
        reward_range = torch.where(ok_r, torch.stack([r, -r]), scalar(-torch.inf, r)).amax(1)
    else:
        reward_range = r.new_full((2,), -torch.inf)
    g = {"exists": exists, "zero_var": zero_var, "size": counts % (B + 1), "B": B, "ref": ref, "neg": -ref}
    block = q.group_block()
    rows = [row.term(g) for row in block.terms]
    # Constant groups at or past each threshold (q.GROUP_THRESHOLDS; the host picks the rule that applies).
    if compiled:
        thresholds = reward_range.unbind() + bounds.unbind()
        rows += [(g[row.base] >= thresholds[k]) & zero_var for row, k in zip(block.kinds, block.at)]
        return [x[:B] for x in rows], reward_range, zero_var
    thresholds = torch.cat([reward_range, bounds])
    if block.index is not None:
        thresholds = thresholds[block.index]
    at_or_past = (torch.stack([g[row.base] for row in block.kinds]) >= thresholds.unsqueeze(1)) & zero_var
    return [torch.cat([torch.stack(rows), at_or_past])[:, :B]], reward_range, zero_var


def _pairs(index: torch.Tensor, env_index: torch.Tensor, E: int, zero_var: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``pairs`` (the episode represents its distinct (group, environment) pair) and
    ``pairs_zero_var`` (and its group is constant), [B] bool each."""
    pair = env_index.add(index, alpha=E)                  # [B] in [0, B * E')
    order = torch.arange(index.shape[0], device=index.device)
    winner = torch.empty(index.shape[0] * E, dtype=torch.int64, device=index.device).scatter_(0, pair, order)
    first = winner.gather(0, pair) == order
    return {"pairs": first, "pairs_zero_var": first & zero_var.gather(0, index)}
