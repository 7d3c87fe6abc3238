"""Per-environment signals: episodes, reward, reward-length correlation, truncation, zero-variance
groups, hack counts (summed on the device; their ratio: rlwatch.values.derive_hack_ratios), failures by
kind (counted on the host)."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from ..values import derive_hack_ratios
from .pending import Pending, Values, _div

def env_signals(out: Pending, env_index: torch.Tensor, env_names: Sequence[str], rewards: torch.Tensor | None,
                ok: torch.Tensor, truncated: torch.Tensor | None,
                groups: tuple[torch.Tensor, torch.Tensor] | None, group_zero_var: torch.Tensor | None,
                hacked: dict[str, torch.Tensor], lengths: torch.Tensor | None = None) -> None:
    """Per-environment episodes, reward, truncation, zero-variance groups and hack rates.

    env_index: [B] int index into env_names. rewards [B], ok/truncated [B] bool, groups: the
    :func:`group_index` of the group ids and group_zero_var its zero-variance flags, hacked: detector
    name -> [B] bool. Failure rates by kind are counted on the host from the string labels.
    """
    E = len(env_names)
    okf = ok.double()
    columns: dict[str, torch.Tensor] = {"episodes": torch.ones_like(okf)}
    if rewards is not None:
        r = torch.where(ok, rewards.double(), 0.0)
        columns.update(ok=okf, r=r)
        if lengths is not None:
            n = lengths.double() * okf
            columns.update(n=n, rr=r * r, nn=n * n, rn=r * n)
    if truncated is not None:
        columns["truncated"] = truncated.double()
    for detector, flags in hacked.items():
        columns["hacked/" + detector] = flags.double()
    # Every per-environment sum in one scatter-add: [E, columns]; the ratios are finished on the host.
    sums = torch.zeros(E, len(columns), dtype=torch.float64, device=env_index.device).index_add_(
        0, env_index, torch.stack(list(columns.values()), 1))
    parts = [out.vector(sums)]
    if group_zero_var is not None and groups is not None:
        # A group counts once for each environment among its episodes (a group whose episodes carry
        # two environments counts in both). Distinct (group, environment) pairs come from one sort
        # of group * E + environment; integer sums make the result independent of the device.
        index = groups[0]
        pair = (index * max(E, 1) + env_index).sort().values                           # [B]
        first = torch.ones_like(pair, dtype=torch.bool)
        if pair.numel() > 1:
            torch.ne(pair[1:], pair[:-1], out=first[1:])
        group_of, env_of = pair // max(E, 1), pair % max(E, 1)
        counted = torch.stack([first, first & group_zero_var[group_of]], 1).to(torch.int64)
        per_env = torch.zeros(E, 2, dtype=torch.int64, device=env_index.device).index_add_(0, env_of, counted)
        parts.append(out.vector(per_env))
    names = list(columns)
    out.host(lambda flat, *zero: _finish_envs(flat, zero[0] if zero else None, names, list(env_names),
                                              list(hacked)), *parts)


def _finish_envs(flat: list[float], zero: list[float] | None, names: list[str], envs: list[str],
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

