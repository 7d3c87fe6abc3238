"""Per-environment signals on the host: the formulas of the per-environment sums of
:func:`.episodes.episode_core` (episodes, reward, reward-length correlation, truncation, zero-variance
groups, hack counts; their ratio: rlwatch.values.derive_hack_ratios), and failures by kind."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from ..values import derive_hack_ratios
from .pending import Values, _div

def finish_envs(flat: list[float], zero: list[float] | None, names: list[str], envs: list[str],
                 detectors: list[str]) -> "Values":
    """Per-environment families from the [E, columns] sums (row-major ``flat``) and the
    [E, 2] (groups, zero-variance groups) counts."""
    C = len(names)
    col = {name: flat[i::C] for i, name in enumerate(names)}
    rows = [(name,) for name in envs]
    out: Values = {}
    episodes = col["episodes"]
    out["env_episodes"] = dict(zip(rows, episodes))
    out["episodes_total"] = dict(zip(rows, episodes))
    if "ok" in col:
        ok, r = col["ok"], col["r"]
        out["env_reward_mean"] = {row: _div(s, n) for row, s, n in zip(rows, r, ok)}
        if "n" in col:
            # Pearson correlation of reward with response length per environment (reward/length hack).
            corr = {}
            for row, k, s_r, s_n, s_rr, s_nn, s_rn in zip(rows, ok, r, col["n"], col["rr"], col["nn"], col["rn"]):
                var = (k * s_rr - s_r * s_r) * (k * s_nn - s_n * s_n)
                corr[row] = (k * s_rn - s_r * s_n) / math.sqrt(max(var, 1e-300)) if k >= 4 and var > 0 else None
            out["env_reward_length_corr"] = corr
    if "truncated" in col:
        trunc = col["truncated"]
        out["env_truncated_ratio"] = {row: _div(t, e) for row, t, e in zip(rows, trunc, episodes)}
        out["episodes_truncated_total"] = dict(zip(rows, trunc))
    if zero is not None:
        out["env_zero_variance_groups_ratio"] = {row: _div(zero[2 * i + 1], zero[2 * i]) for i, row in enumerate(rows)}
    for detector in detectors:
        count = col["hacked/" + detector]
        det_rows = [(name, detector) for name in envs]
        out.setdefault("episodes_hacked_total", {}).update(dict(zip(det_rows, count)))
        out.setdefault("episodes_judged_total", {}).update(dict(zip(det_rows, episodes)))
    derive_hack_ratios(out)
    return out


def failure_counts(env: Sequence[str], failed: Iterable[str | None]) -> dict[tuple[str, str], int]:
    """Host-side count of infrastructure failures per (env, kind) from per-episode labels."""
    counts: dict[tuple[str, str], int] = {}
    for e, kind in zip(env, failed):
        if kind:
            counts[(e, kind)] = counts.get((e, kind), 0) + 1
    return counts

