"""The per-episode signals as one pure tensor function, shaped for ``torch.compile`` like
:func:`rlwatch.signals.fused.token_core`: rewards, zero-variance GRPO groups by kind, response
lengths, truncation and the per-environment sums, packed in one float64 vector whose layout
:func:`episode_layout` describes and whose host formulas :func:`finish_episodes` applies.

Every per-episode quantity is a row of one [K, B] matrix (named by :func:`episode_layout`), reduced
once for the step's sums and once for its maxima; the per-environment sums are one product of its
first rows with the one-hot [E', 1, B] environment matrix, reduced once. About 60 operations for a
step with rewards, groups, truncation and environments, whatever B.

Groups: one sort of the group ids, then each episode's *group slot* is the position of its id's
first occurrence in the sorted ids (one ``searchsorted``): equal ids share a slot, slots are in
[0, B). A group's constancy is tested against one of its own usable rewards (written by a plain
scatter, so whichever write wins gives the same answer); group sizes and the episodes differing from
that reward are integer counts (``bincount`` on CPU, an int64 scatter-add elsewhere). A group counts
once for each environment among its episodes: the (group slot, environment) pairs are numbered and
the episode whose index a plain scatter leaves in a pair's cell is that pair's one representative
(again: any winner gives the same counts).

No host synchronisation, no data-dependent shape, no Python branch on tensor values and no float
atomics: every sum is a reduction, every count an integer, so the values are the same on every
device. A constant group is classified on the host: the device counts constant groups at or past
the batch's reward range, at or past the configured (fail, pass) rewards and above 0, and the host
picks the rule (:func:`finish_episodes`).

Shapes: B episodes; ``per_seq`` [B] response lengths (tokens, integers); ``ok`` [B] bool (episodes
that did not fail for an infrastructure reason); ``rewards`` [B] float64; ``group_ids`` [B] int64;
``env_index`` [B] int64 into E environments, with ``env_slots`` any tensor of E' >= E elements (its
shape is the row count of the per-environment sums, so that one compiled function serves every E up
to E'); ``truncated`` [B] bool; ``hacked`` [D, B] bool; ``bounds`` float64 [3] = :func:`bound_values`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..metrics import ZERO_VARIANCE_KINDS
from .environments import finish_envs
from .pending import Values, _div
from .reduce import count_into

#: The response-length quantile (linear interpolation between order statistics, as torch.quantile).
LENGTH_QUANTILE = 0.99
#: Rows of the group block, one value per group slot: usable episodes > 0, constant, usable episodes
#: of constant groups, usable episodes, B + 1 - usable episodes (0 for an empty slot, so that its
#: maximum gives the smallest group), then the constant groups at the batch's highest reward and at
#: its lowest, at the configured pass and fail rewards, and above 0.
GROUP_ROWS = ("groups", "zero_var", "zero_var_episodes", "size", "size_gap",
              "range_pass", "range_fail", "bounds_pass", "bounds_fail", "sign_pass")


def bound_values(reward_bounds: tuple[float, float] | None) -> tuple[float, float, float]:
    """The ``bounds`` input of :func:`episode_core`: (pass, -fail, the smallest positive float64),
    the thresholds that ``ref >= t`` and ``-ref >= t`` compare group rewards with."""
    fail, passing = (float(b) for b in reward_bounds or (0.0, 0.0))
    return passing, -fail, 5e-324


def _main_rows(rewards: bool, groups: bool, envs: bool, truncated: bool) -> list[str]:
    """The per-episode rows that :func:`episode_core` stacks, in order (``hacked`` rows follow)."""
    rows = ["episodes", "all_ok", "length"]
    if rewards:
        rows += ["ok", "r", "rr"] + (["n", "nn", "rn"] if envs else [])
    if truncated:
        rows.append("truncated")
    if envs and rewards and groups:
        rows += ["pairs", "pairs_zero_var"]
    return rows


def episode_layout(rewards: bool, groups: bool, envs: int, truncated: bool, detectors: list[str]) -> dict[str, Any]:
    """Positions in :func:`episode_core`'s output (``envs`` = E', the rows of the per-environment
    sums; 0 without environments): ``rows`` (name -> row of the [K, B] matrix), then slices of the
    output: ``sums`` [K], ``maxes`` [K], ``range`` (highest reward, -lowest; with groups), ``p99``
    (the two order statistics around the length quantile), ``env`` ([E', width] row-major: the
    first ``width`` rows summed per environment)."""
    groups = rewards and groups
    rows = _main_rows(rewards, groups, envs > 0, truncated) + ["hacked/" + d for d in detectors]
    width = len(rows)
    if groups:
        rows += GROUP_ROWS
    K = len(rows)
    pos: dict[str, Any] = {"rows": {name: k for k, name in enumerate(rows)}, "width": width,
                           "sums": slice(0, K), "maxes": slice(K, 2 * K)}
    at = 2 * K
    if groups:
        pos["range"], at = slice(at, at + 2), at + 2
    pos["p99"], at = slice(at, at + 2), at + 2
    if envs:
        pos["env"], at = slice(at, at + envs * width), at + envs * width
    pos["size"] = at
    return pos


def env_columns(rewards: bool, truncated: bool, detectors: list[str]) -> list[str]:
    """Names of the per-environment sums that :func:`rlwatch.signals.environments.finish_envs` reads."""
    names = ["episodes"]
    if rewards:
        names += ["ok", "r", "n", "rr", "nn", "rn"]
    if truncated:
        names.append("truncated")
    return names + ["hacked/" + d for d in detectors]


def episode_core(per_seq: torch.Tensor, ok: torch.Tensor, rewards: torch.Tensor | None,
                 group_ids: torch.Tensor | None, env_index: torch.Tensor | None, env_slots: torch.Tensor | None,
                 truncated: torch.Tensor | None, hacked: torch.Tensor | None, bounds: torch.Tensor) -> torch.Tensor:
    """Every per-episode sum of one step, packed as :func:`episode_layout` says (float64).

    per_seq: [B] response lengths (tokens); the length quantile is :data:`LENGTH_QUANTILE`,
    interpolated on the host.
    """
    envs = env_index is not None and env_slots is not None
    groups = rewards is not None and group_ids is not None
    lengths = per_seq if per_seq.dtype == torch.float64 else per_seq.double()
    rows: dict[str, torch.Tensor] = {"episodes": torch.ones_like(lengths), "all_ok": ok, "length": lengths}
    if truncated is not None:
        rows["truncated"] = truncated
    compiled = torch.compiler.is_compiling()
    parts: list[torch.Tensor] = []
    group_rows: list[torch.Tensor] = []
    if rewards is not None:
        # A NaN or infinite reward is counted (all_ok - ok) and its episode left out of every reward signal.
        ok_r = ok & torch.isfinite(rewards)
        r = torch.where(ok_r, rewards, 0.0)
        rows.update(ok=ok_r, r=r, rr=r * r)
        if envs:
            n = lengths * ok_r
            rows.update(n=n, nn=n * n, rn=r * n)
        if groups:
            index = torch.searchsorted(group_ids.sort().values, group_ids)      # [B] group slots
            group_rows, reward_range, zero_var = _groups(r, ok_r, index, bounds, compiled)
            parts.append(reward_range)
            if envs:
                rows.update(_pairs(index, env_index, env_slots.shape[0], zero_var))
    main = [rows[name] for name in _main_rows(rewards is not None, groups, envs, truncated is not None)]
    sums = _reduce(main, hacked, group_rows, env_index if envs else None,
                   env_slots.shape[0] if envs else 0, compiled)
    return torch.cat([*sums[:2], *parts, _length_order_statistics(per_seq.sort().values), *sums[2:]])


def _reduce(main: list[torch.Tensor], hacked: torch.Tensor | None, group_rows: list[torch.Tensor],
            env_index: torch.Tensor | None, E: int, compiled: bool) -> list[torch.Tensor]:
    """The sums [K] and maxima [K] of the rows (``main``, then ``hacked`` [D, B], then
    ``group_rows``: [B] rows or [k, B] blocks), and with environments the [E', width] row-major sums
    of the first ``width`` = len(main) + D rows per environment, all from one [K, B] float64 matrix.
    Eagerly the matrix is one stack and one cat. Compiled it is one chain of ``where`` over the row
    number: inductor lowers a CPU cat (and a GPU cat of more than 8 inputs) to one copy loop per
    input, while the chain is one elementwise loop (it evaluates every row at each element: a few
    dozen operations per element, nothing against a launch)."""
    D = hacked.shape[0] if hacked is not None else 0
    width = len(main) + D
    if compiled:
        rows = main + (list(hacked.unbind()) if hacked is not None else []) + group_rows
        row = torch.arange(len(rows), device=rows[0].device).view(-1, 1)
        m = rows[-1].double().expand(len(rows), -1)
        for k in range(len(rows) - 2, -1, -1):
            m = torch.where(row == k, rows[k], m)
    else:
        matrix = [torch.stack(main)] + ([hacked] if hacked is not None else []) + group_rows
        m = torch.cat(matrix) if len(matrix) > 1 else matrix[0]
    B = m.shape[1]
    out = [m.sum(1), m.amax(1) if B else m.new_full((m.shape[0],), torch.nan)]
    if E:
        slots = torch.arange(E, device=m.device).view(-1, 1, 1)
        block = m[:width] if width < m.shape[0] else m
        out.append(((env_index == slots) * block).sum(-1).reshape(-1))      # [E', width]
    return out


def _length_order_statistics(sorted_lengths: torch.Tensor) -> torch.Tensor:
    """[2]: the order statistics lo and min(lo + 1, B - 1) of the sorted [B] lengths, lo =
    floor(LENGTH_QUANTILE * (B - 1)); NaN for an empty batch (which compiled code never sees)."""
    B = sorted_lengths.shape[0]
    if torch.compiler.is_compiling():          # B is symbolic: the positions as a tensor
        device = sorted_lengths.device
        rank = torch.full((2,), LENGTH_QUANTILE, dtype=torch.float64, device=device) * (B - 1)
        return sorted_lengths[(rank.floor().long() + torch.arange(2, device=device)).clamp_max(B - 1)]
    if B == 0:
        return torch.full((2,), torch.nan, dtype=torch.float64, device=sorted_lengths.device)
    if B == 1:
        return sorted_lengths.expand(2)
    lo = math.floor(LENGTH_QUANTILE * (B - 1))
    return sorted_lengths[lo:lo + 2]


def _groups(r: torch.Tensor, ok_r: torch.Tensor, index: torch.Tensor, bounds: torch.Tensor,
            compiled: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The :data:`GROUP_ROWS` per group slot (one [10, B] matrix eagerly, ten [B] rows compiled),
    the batch's reward range [2] (highest, -lowest usable reward; -inf without one) and the constant
    flags per slot [B + 1] bool."""
    B = r.shape[0]
    slot = torch.where(ok_r, index, B)                    # usable episodes; slot B collects the others
    # One usable reward of each group (a slot without one keeps whatever the buffer held: only
    # episodes that go to slot B read it, and only constant groups' values are used).
    ref = r.new_empty(B + 1).scatter_(0, slot, r)
    # Per slot: usable episodes + (B + 1) * those differing from the slot's reward, one integer sum.
    counts = count_into(B + 1, slot, torch.where(r != ref.gather(0, index), B + 2, 1))
    exists = counts > 0
    zero_var = exists & (counts <= B)
    size = counts % (B + 1)
    if B:
        reward_range = torch.where(ok_r, torch.stack([r, -r]), -torch.inf).amax(1)
    else:
        reward_range = r.new_full((2,), -torch.inf)
    # Constant groups at or past each threshold: ref >= highest, -ref >= -lowest, ref >= pass,
    # -ref >= -fail, ref > 0 (the host picks the rule that applies).
    neg = -ref
    slots = [exists, zero_var, zero_var * size, size, (B + 1 - size) * exists]
    if compiled:
        thresholds = reward_range.unbind() + bounds.unbind()
        kinds = [(x >= t) & zero_var for x, t in zip((ref, neg, ref, neg, ref), thresholds)]
        return [x[:B] for x in slots + kinds], reward_range, zero_var
    thresholds = torch.cat([reward_range, bounds]).unsqueeze(1)
    kinds = (torch.stack([ref, neg, ref, neg, ref]) >= thresholds) & zero_var
    return [torch.cat([torch.stack(slots), kinds])[:, :B]], reward_range, zero_var


def _pairs(index: torch.Tensor, env_index: torch.Tensor, E: int, zero_var: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``pairs`` (the episode represents its distinct (group, environment) pair) and
    ``pairs_zero_var`` (and its group is constant), [B] bool each."""
    pair = env_index.add(index, alpha=E)                  # [B] in [0, B * E')
    order = torch.arange(index.shape[0], device=index.device)
    winner = torch.empty(index.shape[0] * E, dtype=torch.int64, device=index.device).scatter_(0, pair, order)
    first = winner.gather(0, pair) == order
    return {"pairs": first, "pairs_zero_var": first & zero_var.gather(0, index)}


def finish_episodes(v: list[float], pos: dict[str, Any], envs: list[str], columns: list[str],
                    detectors: list[str], reward_bounds: tuple[float, float] | None = None) -> Values:
    """The host formulas of the episode signals from :func:`episode_core`'s vector ``v``
    (``reward_bounds``: the configured (fail, pass) rewards, None when inferred per batch)."""
    rows = pos["rows"]
    sums, maxes = v[pos["sums"]], v[pos["maxes"]]

    def total(name: str) -> float:
        return sums[rows[name]]

    B = total("episodes")
    out: Values = {}
    if "ok" in rows:
        n, s = total("ok"), total("r")
        nonfinite = total("all_ok") - n
        out["nonfinite_rewards"] = {(): nonfinite}
        out["nonfinite_rewards_total"] = {(): nonfinite}
        out["reward_mean"] = {(): _div(s, n)}
        out["reward_std"] = {(): _std([n, s, total("rr")])}
    if "groups" in rows:
        groups = total("groups")
        kinds = _constant_kinds(total, v[pos["range"]], reward_bounds)
        out["groups"] = {(): groups}
        out["groups_total"] = {(): groups}
        out["zero_variance_groups_ratio"] = {(k,): _div(c, groups) for k, c in zip(ZERO_VARIANCE_KINDS, kinds)}
        out["zero_variance_groups_total"] = {(k,): c for k, c in zip(ZERO_VARIANCE_KINDS, kinds)}
        out["zero_gradient_episodes_ratio"] = {(): _div(total("zero_var_episodes"), total("ok"))}
        gap = maxes[rows["size_gap"]]
        out["_group_size_min"] = {(): B + 1 - gap if gap > 0 else None}
        out["_group_size_max"] = {(): maxes[rows["size"]]}
    out["response_length_mean"] = {(): _div(total("length"), B)}
    out["response_length_max"] = {(): maxes[rows["length"]]}
    out["response_length_p99"] = {(): _quantile(*v[pos["p99"]], B)}
    if "truncated" in rows:
        out["truncated_ratio"] = {(): _div(total("truncated"), B)}
    if "env" in pos:
        width, env = pos["width"], v[pos["env"]]
        flat = [env[e * width + rows[c]] for e in range(len(envs)) for c in columns]
        zero = None
        if "pairs" in rows:
            zero = [env[e * width + rows[c]] for e in range(len(envs)) for c in ("pairs", "pairs_zero_var")]
        out.update(finish_envs(flat, zero, columns, envs, detectors))
    return {name: {k: (x if x is not None and math.isfinite(x) else None) for k, x in rows_.items()}
            for name, rows_ in out.items()}


def _constant_kinds(total: Any, reward_range: list[float],
                    reward_bounds: tuple[float, float] | None) -> tuple[float, float, float]:
    """Constant groups passing, failing and other. Classified by the configured (fail, pass)
    rewards, else by the batch's range (a constant group at its highest reward passes, at its
    lowest fails); when these do not span an interval (one constant batch), by sign."""
    if reward_bounds is not None:
        fail, passing = reward_bounds
        rule = "bounds" if passing > fail else "sign"
    else:
        highest, neg_lowest = reward_range
        rule = "range" if highest > -neg_lowest else "sign"
    zero = total("zero_var")
    at_pass = total(rule + "_pass")
    at_fail = zero - at_pass if rule == "sign" else total(rule + "_fail")
    return at_pass, at_fail, zero - at_pass - at_fail


def _std(moments: list[float]) -> float | None:
    """Population standard deviation from [n, sum x, sum x^2]."""
    n, s, sq = moments
    return math.sqrt(max(sq / n - (s / n) ** 2, 0.0)) if n else None


def _quantile(lo_value: float, hi_value: float, B: float) -> float | None:
    """The LENGTH_QUANTILE quantile from its two order statistics (the formula of torch.quantile)."""
    if not B:
        return None
    rank = LENGTH_QUANTILE * (B - 1)
    return lo_value + (rank - math.floor(rank)) * (hi_value - lo_value)
