"""The version-lag block of :func:`.fused.token_core`: a chunk's lag histogram, per-sequence sums and
largest lag (:func:`lag_part`), and the step's lag fields from them (:func:`lag_finish`,
:data:`~.quantities.LAG_FIELDS`).

Versions: [B, T] per token, [B] or [B, 2] (first, last) per sequence; ``trainer_version`` 0-d, float32
when below 2**24 (then each integer version up to it + 1 is a float32 exactly), else float64.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from . import quantities as q
from .reduce import cached, count_into, interpolate, ranks, scalar
from .settings import LAG_BINS

LAG_SIZE = LAG_BINS + 1                 # bin k holds lag k - 1; bin 0 off-mask and negative lags
# The lag bucket (index into LAG_BUCKET_LABELS) of each lag bin; bin 0 (no valid lag) in none.
LAG_BUCKET_OF_BIN = (len(q.BY_LABELS["lag"]),) + tuple(
    bisect_left(tuple(int(b) for b in q.BY_LABELS["lag"][:-1]), lag) for lag in range(LAG_BINS))
# Moves lag + 1 on the mask below the 0s off it, for the smallest lag: exact below 2**24, as the lags.
_SHIFT = float(2 ** 24)


def lag_part(version: torch.Tensor, trainer_version: torch.Tensor, mask: torch.Tensor,
             per_seq: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A chunk's lag histogram [LAG_BINS] (tokens by lag 0 .. LAG_EXACT_MAX, larger lags in the last
    bin), per-sequence sums [3] (sequences with a token, their largest lags, those spanning versions),
    the largest lag [1]; and each token's lag bin ([B, T] int32, or [B, 1] int64: lag + 1, 0 where no valid
    lag)."""
    B, T = mask.shape
    if version.shape == mask.shape:
        if version.dtype not in (torch.float32, torch.float64, torch.int32, torch.int64):
            version = version.float() if version.dtype.is_floating_point else version.long()
        # lag + 1, 0 off the mask: float32 (exact for lags below 2**24) from integer versions, the versions'
        # dtype from floats; one dtype per operation (mixed ones are several times slower on CPU).
        if not version.dtype.is_floating_point and trainer_version.dtype == torch.float32:
            # Integer versions as float32 first (exact up to trainer_version + 1; the conversion keeps the
            # order of larger ones and the sign): half the bytes of an int64 difference.
            plus_one = _version_plus_one(trainer_version, torch.float32)
            lag1 = version.float().neg_().add_(plus_one)                     # (in the conversion's buffer)
        else:
            plus_one = _version_plus_one(trainer_version, version.dtype)
            lag1 = (plus_one - version) if version.dtype.is_floating_point else (plus_one - version).float()
        # A negative version (lag + 1 above trainer_version + 1) is no version: 0, as one newer than the
        # trainer (negative_lag_tokens_total). The record checks every other layout and float versions.
        lag1 = lag1.masked_fill_(lag1 > plus_one, 0.0).mul_(mask)
        if T:
            top = lag1.amax(-1)                               # 1 + the largest lag of the sequence (>= 0)
            # The smallest lag + 1 on the mask: the minimum of lag1 - 2**24 on the mask, below the 0s off it
            # (exact for lags below 2**24). One operation, where torch.where needs a boolean mask first.
            shifted = torch.add(lag1, mask, alpha=-_SHIFT)
            # 0/1 in lag1's dtype (one dtype in the stack below); never without a token (0 + 2**24).
            spans = (shifted.amin(-1) + scalar(_SHIFT, shifted)).lt_(top)
        else:
            top, spans = per_seq, per_seq
        has = per_seq.clamp(max=1.0)                                          # 0/1 (whole numbers)
        # The lag bins, int32 (half the bytes of int64 for the histograms' bincounts); not histc: ~1.4 ms
        # on CPU for any input.
        index = lag1.clamp_(0.0, float(LAG_SIZE - 1)).int()                # (lag1 is not read after)
        hist = count_into(LAG_SIZE, index)[1:]
        seq_max = top - scalar(1.0, top)
        # A sequence without tokens (top 0) adds 0 to the sums; to the maximum it adds -1 instead of 0,
        # which changes it only when no token has a lag >= 0 (n_ok = 0: not reported).
    else:
        has = per_seq > scalar(0.0, per_seq)
        if version.dim() == 2:
            first, last = version.unbind(-1)
            spans = (last != first) & has
        else:
            first = version.reshape(-1)
            spans = torch.zeros_like(has)
        if first.dtype.is_floating_point and first.dtype != torch.float64:
            first = first.double()
        seq_max = trainer_version.double() - first                                      # [B] float64
        index = (seq_max + 1.0).clamp(0, LAG_SIZE - 1).long()
        hist = count_into(LAG_SIZE, index, per_seq)[1:]               # sequences without tokens weigh 0
        seq_max = torch.where(has, seq_max, 0.0)
        index = index.unsqueeze(1)
    seq_sums = torch.stack([has, seq_max.clamp_min(0), spans]).sum(-1, dtype=torch.float64)
    lag_max = seq_max.amax(0, keepdim=True) if B else seq_max.new_zeros(1)
    return [hist, seq_sums, lag_max], index


def _version_plus_one(trainer_version: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """trainer_version + 1 (0-d) as the versions' dtype (int64 for integers; 0-d, so that it does
    not promote them)."""
    plus_one = trainer_version + scalar(1.0, trainer_version)
    dtype = dtype if dtype.is_floating_point else torch.int64
    return plus_one if plus_one.dtype == dtype else plus_one.to(dtype)


def lag_finish(hist: torch.Tensor, seq_sums: torch.Tensor, lag_max: torch.Tensor, bucket_index: torch.Tensor,
                qs: torch.Tensor, over_from: torch.Tensor) -> list[torch.Tensor]:
    """The lag block (``LAG_FIELDS``) from the step's lag histogram and sums."""
    cum = hist.cumsum(0, dtype=torch.float64)
    n_ok = cum[-1:]                                                           # tokens of lag >= 0
    # sum(cum) (the sum of the lags is LAG_BINS * n_ok - sum(cum)) and the tokens over the bound, as one
    # product with cum (exact: whole numbers below 2**53).
    weights = cached(("lag_sums", cum.device), lambda: _lag_sum_weights(over_from, cum.device), on=over_from)
    sums = torch.mv(weights, cum)
    lohi, frac = ranks(n_ok, qs)
    quantiles = interpolate(torch.searchsorted(cum, lohi, right=True).double(), frac)   # bin k: lag k
    return [cum.index_select(0, bucket_index), n_ok, sums, quantiles, seq_sums, lag_max]


def _lag_sum_weights(over_from: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[2, LAG_BINS] float64: the weights of the cumulative counts whose products with them are sum(cum) and
    the count of lags >= ``over_from`` (a count weighted o_k is the cumulative counts weighted o_k - o_k+1)."""
    over = (torch.arange(LAG_BINS, dtype=torch.float64, device=device) >= over_from.to(device)).double()
    return torch.stack([torch.ones_like(over), over - torch.cat([over[1:], over.new_zeros(1)])])
