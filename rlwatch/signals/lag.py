"""Policy-version lag (staleness): per-token or per-sequence versions, the exact lag histogram and
its classic buckets."""

from __future__ import annotations

import math
import operator

import torch

from ..metrics import LAG_BUCKETS
from .pending import Pending, _div
from .reduce import _constant, _dot, bin_counts, quantile_from_counts
from .settings import LAG_EXACT_MAX, SignalConfig, Workspace


def lag_signals(out: Pending, version: torch.Tensor, trainer_version: int, mask: torch.Tensor,
                config: SignalConfig, ws: Workspace | None = None,
                tokens_per_seq: torch.Tensor | None = None) -> None:
    """Policy-version lag (staleness).

    version: [B, T] per-token versions, [B] per-sequence versions, or [B, 2] (first, last) versions
    per sequence (a trajectory that spans versions, as verl's min/max_global_steps). For [B, 2] each
    token is assigned the first version, an upper bound on its lag. mask: [B, T] float 0/1.
    Tokens stamped with a version newer than the trainer's (negative lag) are counted and excluded.
    """
    ws = ws or Workspace()
    B, T = mask.shape
    device = mask.device
    tokens_per_seq = mask.sum(-1) if tokens_per_seq is None else tokens_per_seq   # [B]
    n_mask = tokens_per_seq.sum().double()
    size = LAG_EXACT_MAX + 2                                                 # bin k holds lag k - 1
    if version.dim() == 2 and version.shape == mask.shape:
        counts, lag1 = token_lag_counts(version, trainer_version, mask, ws)
        tmp = ws.get("lag_tmp", mask.shape, torch.float32, device)
        negative = counts[0] - (lag1.numel() - n_mask)
        seq_max = lag1.amax(-1) - 1.0 if T else torch.full((B,), -1.0, device=device)
        big = float(size) * 4.0
        seq_min = torch.add(lag1, mask, alpha=-big, out=tmp).amin(-1) + big - 1.0 if T else seq_max
        has = tokens_per_seq > 0
        spans = ((seq_max > seq_min) & has).double()
        seq_max = torch.where(has, seq_max, torch.zeros_like(seq_max))
    else:
        if version.dim() == 2 and version.shape[-1] == 2:
            first, last = version[:, 0], version[:, 1]
            spans = ((last != first) & (tokens_per_seq > 0)).double()
        else:
            first = version.reshape(-1)
            spans = torch.zeros(B, dtype=torch.float64, device=device)
        seq_lag = first.to(torch.float64).neg().add(float(trainer_version))  # [B]
        weights = tokens_per_seq.to(torch.float64)
        idx = seq_lag.add(1.0).clamp(0, size - 1).to(torch.int64)
        idx = torch.where(tokens_per_seq > 0, idx, torch.zeros_like(idx))
        counts = bin_counts(idx, size, weights)
        negative = _dot((seq_lag < 0).double(), weights)
        seq_max = torch.where(tokens_per_seq > 0, seq_lag, torch.zeros_like(seq_lag))
    hist = counts[1:]                                                         # lags 0 .. LAG_EXACT_MAX
    lag_values = torch.arange(hist.numel(), device=hist.device, dtype=torch.float64)
    lag_sum = _dot(hist, lag_values)
    lag_max = seq_max.amax() if B else torch.zeros((), device=device)
    n_ok = n_mask - negative.double()
    over = hist[int(math.floor(config.staleness_bound)) + 1:].sum()
    has_seq = (tokens_per_seq > 0).double()
    # n_seq, the sum of the per-sequence maximum lags, the sequences spanning versions: one product.
    seq_sums = torch.mv(torch.stack([has_seq, seq_max.double().clamp_min(0), spans]), has_seq)
    out.put("negative_lag_tokens_total", negative)
    out.ratio("version_lag_mean", lag_sum, n_ok)
    out.derive("version_lag_max", lambda m, n: m if n > 0 else None, lag_max, n_ok)
    out.put("version_lag_p99", quantile_from_counts(hist, lag_values, n_ok, (0.99,))[0])
    out.ratio("version_lag_over_bound_ratio", over, n_ok)
    out.put("tokens_over_staleness_bound_total", over)
    out.derive("version_lag_sequence_max_mean", lambda sums: _div(sums[1], sums[0]), seq_sums)
    out.derive("partial_rollout_ratio", lambda sums: _div(sums[2], sums[0]), seq_sums)
    out.derive("partial_rollout_sequences_total", operator.itemgetter(2), seq_sums)
    put_lag_histogram(out, hist, n_ok, lag_sum)


def token_lag_counts(version: torch.Tensor, trainer_version: int, mask: torch.Tensor,
                     ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram of per-token lag: counts [LAG_EXACT_MAX + 2] where bin k holds lag k - 1 and bin 0
    holds off-mask and negative-lag tokens; also returns lag + 1 per token ([B, T], 0 off the mask)."""
    size = LAG_EXACT_MAX + 2
    lag1 = torch.mul(mask, float(trainer_version) + 1.0, out=ws.get("lag", mask.shape, torch.float32, mask.device))
    lag1.addcmul_(version, mask, value=-1)
    bins = ws.get("lag_bins", mask.shape, torch.int32, mask.device)
    bins.copy_(torch.clamp(lag1, 0.0, float(size - 1), out=ws.get("lag_tmp", mask.shape, torch.float32,
                                                                   mask.device)))
    return bin_counts(bins, size), lag1


def put_lag_histogram(out: Pending, hist: torch.Tensor, n_ok: torch.Tensor, lag_sum: torch.Tensor) -> None:
    """Classic histogram buckets from exact lag counts (``hist[k]`` = tokens with lag k): per-bucket
    (non-cumulative) counts in LAG_BUCKETS order then +Inf, and the sum for ``_sum``."""
    cum_at = hist.cumsum(0)[_constant(LAG_BUCKETS, hist.device, torch.int64)]
    out.derive_vector("token_version_lag", _bucket_counts, [(str(b),) for b in LAG_BUCKETS] + [("+Inf",)],
                      cum_at, n_ok)
    out.put("token_version_lag_sum", lag_sum)


def _bucket_counts(cumulative: list[float], total: float) -> list[float]:
    """Per-bucket counts from cumulative counts at the bucket bounds, then the rest up to ``total``."""
    return [b - a for a, b in zip([0.0, *cumulative], [*cumulative, total])]

