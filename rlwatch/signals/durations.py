"""Episode durations of one step (the rollout-system signals, docs/rollout-system.md): the tail of
the trained episodes' durations for the step and per environment, the per-environment histogram,
the dropped episodes' sums and an evenly spaced sample of the per-episode durations, packed in one
float64 vector on the durations' device (:func:`duration_core`) and finished on the host after the
step's one transfer (:func:`finish_durations`).

Per environment, one stable sort by duration then one stable sort by environment puts each
environment's known durations in ascending order in one contiguous segment (unknown durations,
NaN, sort as +inf at each segment's end); the quantiles are gathered at positions computed from the
segments' counts, on the device: no host synchronisation, no Python loop over episodes.

Shapes: ``d`` [B] float64 seconds (NaN unknown); ``env_index`` [B] int64 into E environments;
``bounds`` [nb] float64 bucket upper bounds; ``dropped_d``, ``dropped_len`` [D] float64 (NaN unknown).
"""

from __future__ import annotations

import math

import torch

from .buckets import DURATION_BUCKET_LABELS, DURATION_BUCKETS, DURATION_SAMPLE_MAX
from .pending import Values
from .reduce import constant, count_into

#: The quantiles of the tail, in the order of each segment's block after (count, sum, max).
QUANTILES = (0.5, 0.95)
#: Values per segment: count, sum, max, p50, p95.
SEGMENT = 3 + len(QUANTILES)


def _segment_stats(s: torch.Tensor, start: torch.Tensor, n: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """[S, SEGMENT]: count, sum, max and the quantiles of each segment of the sorted ``s`` [B] (known
    values first, ascending) starting at ``start`` [S] with ``n`` [S] known values summing to ``total``."""
    B = s.shape[0]
    last = (B - 1) if B else 0
    nf = n.double()
    qs = constant(QUANTILES, s.device).view(1, -1)
    pos = (nf.view(-1, 1) - 1).clamp_min(0) * qs                          # [S, Q] linear interpolation
    lo = pos.floor()
    hi = torch.minimum(lo + 1, (nf.view(-1, 1) - 1).clamp_min(0))
    base = start.view(-1, 1)
    at_lo = s[(base + lo.long()).clamp(0, last)]
    at_hi = s[(base + hi.long()).clamp(0, last)]
    frac = pos - lo
    quant = at_lo + (at_hi - at_lo) * frac                                # [S, Q]
    top = s[(start + n - 1).clamp(0, last)]
    return torch.cat([nf.view(-1, 1), total.view(-1, 1), top.view(-1, 1), quant], 1)


def duration_core(d: torch.Tensor, env_index: torch.Tensor | None, E: int, dropped_d: torch.Tensor | None,
                  dropped_len: torch.Tensor | None) -> torch.Tensor:
    """The step's duration vector (float64), laid out as :func:`layout` says. B must be positive."""
    device = d.device
    known = d == d
    key = torch.where(known, d, torch.full_like(d, math.inf))
    value = torch.where(known, d, torch.zeros_like(d))
    s, by_duration = key.sort(stable=True)
    step_stats = _segment_stats(s, torch.zeros(1, dtype=torch.int64, device=device), known.sum().view(1),
                                value.sum().view(1))
    parts = [step_stats.reshape(-1)]
    if env_index is not None and E:
        order = by_duration[env_index[by_duration].sort(stable=True).indices]          # by environment, then duration
        s_env = key[order]
        size = count_into(E, env_index)
        start = torch.cumsum(size, 0) - size
        n = count_into(E, env_index, known.long()).long()
        slots = torch.arange(E, device=device).view(-1, 1)
        total = ((env_index == slots) * value).sum(1)               # a reduction, not float atomics: exact order
        parts.append(_segment_stats(s_env, start, n, total).reshape(-1))
        bounds = constant(DURATION_BUCKETS, device)
        nb = len(DURATION_BUCKET_LABELS)
        bucket = torch.searchsorted(bounds, key)                           # le: d <= bound; inf -> +Inf
        cell = torch.where(known, env_index * nb + bucket, torch.full_like(bucket, E * nb))
        parts.append(count_into(E * nb + 1, cell)[:-1].double())
    if dropped_d is not None:
        dk = dropped_d == dropped_d
        parts.append(torch.stack([dk.sum().double(), torch.where(dk, dropped_d, 0.0).sum()]))
    if dropped_len is not None:
        lk = dropped_len == dropped_len
        parts.append(torch.stack([lk.sum().double(), torch.where(lk, dropped_len, 0.0).sum()]))
    parts.append(d[sample_positions(d.shape[0], device)])
    if dropped_d is not None and dropped_d.shape[0]:
        parts.append(dropped_d[sample_positions(dropped_d.shape[0], device)])
    return torch.cat(parts)


def sample_positions(n: int, device: torch.device) -> torch.Tensor:
    """The positions of the stored sample of ``n`` episodes: all of them up to
    :data:`DURATION_SAMPLE_MAX`, else that many evenly spaced (first and last included)."""
    k = min(n, DURATION_SAMPLE_MAX)
    if k == n:
        return torch.arange(n, device=device)
    return torch.arange(k, device=device) * (n - 1) // (k - 1)


def _sample_index(n: int) -> list[int]:
    if n <= DURATION_SAMPLE_MAX:
        return list(range(n))
    k = DURATION_SAMPLE_MAX
    return [i * (n - 1) // (k - 1) for i in range(k)]


def _tail(block: list[float]) -> dict[str, float | None]:
    n, total, top, p50, p95 = block
    if not n:
        return {}
    mean = total / n
    return {"mean_seconds": mean, "p50_seconds": p50, "p95_seconds": p95, "max_seconds": top,
            "max_over_mean": top / mean if mean > 0 else None}


def finish_durations(v: list[float], B: int, envs: list[str], env_of: list[str] | None, dropped: bool,
                     dropped_len: bool, reasons: list[str], dropped_env: list[str]) -> Values:
    """The duration families from :func:`duration_core`'s vector (``v``), and the internal sums
    ``_rollout{(name,)}`` (``trained_n``, ``trained_sum``; with dropped durations ``dropped_n``,
    ``dropped_sum``; with dropped lengths ``dropped_len_n``, ``dropped_len_sum``) that
    :func:`rollout_values` reads."""
    out: Values = {}
    at = SEGMENT
    tail = _tail(v[:SEGMENT])
    for key, x in tail.items():
        out[f"episode_duration_{key}"] = {(): x}
    if tail:
        out["straggler_wait_seconds"] = {(): v[2] - v[3]}
    nb = len(DURATION_BUCKET_LABELS)
    if envs:
        for e, name in enumerate(envs):
            for key, x in _tail(v[at + e * SEGMENT: at + (e + 1) * SEGMENT]).items():
                out.setdefault(f"env_episode_duration_{key}", {})[(name,)] = x
        sums = v[at:at + len(envs) * SEGMENT]
        at += len(envs) * SEGMENT
        hist: dict[tuple[str, ...], float | None] = {}
        total: dict[tuple[str, ...], float | None] = {}
        for e, name in enumerate(envs):
            if sums[e * SEGMENT]:
                for b, label in enumerate(DURATION_BUCKET_LABELS):
                    hist[(name, label)] = v[at + e * nb + b]
                total[(name,)] = sums[e * SEGMENT + 1]
        out["episode_duration_seconds"] = hist
        out["episode_duration_seconds_sum"] = total
        at += len(envs) * nb
    internal = {("trained_n",): v[0], ("trained_sum",): v[1]}
    if dropped:
        internal.update({("dropped_n",): v[at], ("dropped_sum",): v[at + 1]})
        at += 2
    if dropped_len:
        internal.update({("dropped_len_n",): v[at], ("dropped_len_sum",): v[at + 1]})
        at += 2
    out["_rollout"] = internal
    sample: dict[tuple[str, ...], float | None] = {}
    for i in _sample_index(B):
        x = v[at]
        at += 1
        if x == x:
            sample[("trained", env_of[i] if env_of else "default", str(i))] = x
    if dropped:
        for i in _sample_index(len(reasons)):
            x = v[at]
            at += 1
            if x == x:
                sample[(reasons[i], dropped_env[i], str(i))] = x
    if sample:
        out["episode_duration_sample_seconds"] = sample
    return out


def rollout_values(values: Values, B: int, env: list[str] | None, phases: dict[str, float],
                   dropped: "object | None") -> None:
    """The host-side rollout families, into ``values`` after the transfer: phases, the trained,
    launched and dropped counters per environment (and reason), and the launched-versus-trained
    means and ratios from the internal ``_rollout`` sums (removed here). ``dropped`` is a
    :class:`rlwatch.core.rollout.Dropped` (reasons, env) or None."""
    for name, seconds in phases.items():
        values.setdefault("phase_seconds", {})[(name,)] = seconds
        values.setdefault("phase_seconds_total", {})[(name,)] = seconds
    if "sync" in phases:
        values["weight_sync_seconds"] = {(): phases["sync"]}
        values["weight_sync_seconds_total"] = {(): phases["sync"]}
    trained: dict[tuple[str, ...], float | None] = {}
    for e in env or ["default"] * B:
        trained[(e,)] = (trained.get((e,)) or 0.0) + 1.0
    internal = values.pop("_rollout", None)
    if B and (internal is not None or dropped is not None):        # the step has rollout inputs
        values["episodes_trained_total"] = trained
    internal = internal or {}
    if dropped is None:
        return
    launched = dict(trained)
    counts: dict[tuple[str, ...], float | None] = {}
    for reason, e in zip(dropped.reasons, dropped.env):
        counts[(e, reason)] = (counts.get((e, reason)) or 0.0) + 1.0
        launched[(e,)] = (launched.get((e,)) or 0.0) + 1.0
    values["episodes_dropped_total"] = counts
    values["episodes_launched_total"] = launched
    n, total = internal.get(("trained_n",)), internal.get(("trained_sum",))
    if n and ("dropped_n",) in internal:
        all_n = n + internal[("dropped_n",)]
        launched_mean = (total + internal[("dropped_sum",)]) / all_n
        values["trained_episode_duration_mean_seconds"] = {(): total / n}
        values["launched_episode_duration_mean_seconds"] = {(): launched_mean}
        values["length_bias_duration_ratio"] = {(): (total / n) / launched_mean if launched_mean > 0 else None}
    length = (values.get("response_length_mean") or {}).get(())
    if length is not None and ("dropped_len_n",) in internal:
        launched_length = (length * B + internal[("dropped_len_sum",)]) / (B + internal[("dropped_len_n",)])
        values["trained_response_length_mean"] = {(): length}
        values["launched_response_length_mean"] = {(): launched_length}
        values["length_bias_length_ratio"] = {(): length / launched_length if launched_length > 0 else None}
