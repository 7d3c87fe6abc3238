"""The per-token signals as one pure tensor function, shaped for ``torch.compile``.

:func:`token_core` computes every token-level quantity of a step (mismatch, importance sampling,
|r| quantiles, probability bands, version lag) and returns them packed in one float64 vector whose
layout :func:`layout` describes, so a step's device work ends in a single host transfer.

It has no host synchronisation, no data-dependent shape and no Python branch on tensor values:
``torch.compile(token_core, fullgraph=True, dynamic=True)`` traces it without a graph break, and
inductor fuses its elementwise passes and reductions into a few kernels. Eagerly it is also the
cheapest path for small steps (fewer, larger operations than the in-place path of
:mod:`rlwatch.signals.mismatch` and :mod:`rlwatch.signals.lag`). Histograms use integer counts
(int64 scatter-adds, never float atomics).

Shapes: ``mask`` [B, T] float32 0/1; log-probs [B, T] any float dtype; ``version`` [B, T], [B]
or [B, 2]. Thresholds arrive as small tensors (not Python numbers) so that a new configuration
does not recompile.
"""

from __future__ import annotations

import torch

from .reduce import ABS_FIRST, ABS_NBINS, ABS_SHIFT
from .settings import LAG_EXACT_MAX, SAFETY_BOUND

LAG_SIZE = LAG_EXACT_MAX + 2            # bin k holds lag k - 1; bin 0 off-mask and negative lags

#: Names of the mismatch block, in order (``band`` entries follow: |r| sum and tokens per band).
MISMATCH_FIELDS = (
    "nonfinite", "n", "sum_r", "sum_r2", "sum_a", "max_a", "sum_k3", "sum_em1", "sq_em1", "sum_em1t", "sq_em1t",
    "high", "low", "mis_below", "mis_above", "rs", "ss", "s_sum",
    "seq_n", "seq_abs", "seq_chi2", "seq_high", "seq_low", "seq_mis", "seq_max", "q50", "q99", "min_r", "max_r",
)
#: Names of the lag block, in order (then the cumulative counts at the histogram buckets).
LAG_FIELDS = ("negative", "lag_sum", "lag_max", "n_ok", "over", "lag_seq_n", "lag_seq_max_sum", "spans", "lag_p99")


def layout(mismatch: bool, lag: bool, bands: int, buckets: int) -> dict[str, int | slice]:
    """Positions in :func:`token_core`'s output: ``tokens`` first, then the mismatch block (with
    ``bands`` as a slice of 2 * bands values), the lag block (with ``lag_cum`` a slice), and last
    ``compiled`` (1 when compiled code produced the vector)."""
    at, pos = 1, {"tokens": 0}
    if mismatch:
        for name in MISMATCH_FIELDS:
            pos[name], at = at, at + 1
        pos["bands"], at = slice(at, at + 2 * bands), at + 2 * bands
    if lag:
        for name in LAG_FIELDS:
            pos[name], at = at, at + 1
        pos["lag_cum"], at = slice(at, at + buckets), at + buckets
    pos["compiled"], at = at, at + 1
    pos["size"] = at
    return pos


def _count_into(counts: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """counts [K] int64 += occurrences (or integer ``weights``) of ``index`` values in [0, K)."""
    index = index.reshape(-1)
    if index.device.type == "cpu" and not torch.compiler.is_compiling():     # one operation, no atomics
        found = torch.bincount(index, None if weights is None else weights.reshape(-1).double(), counts.numel())
        return counts + found[:counts.numel()].long()
    index = index.long()
    src = torch.ones_like(index) if weights is None else weights.reshape(-1).long()
    return counts.scatter_add(0, index, src)


def _sums(columns: list[torch.Tensor]) -> torch.Tensor:
    """The sum of each column [len(columns)]. Compiled, separate sums fuse into one pass without
    materialising the columns; eagerly, one stacked reduction costs one operation instead of many."""
    if torch.compiler.is_compiling():
        return torch.stack([c.sum() for c in columns])
    return torch.stack(columns).reshape(len(columns), -1).sum(-1)


def _quantiles(n: torch.Tensor, qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lower and upper order statistics (0-based float64) and the fraction between them, per q
    (linear interpolation, as ``torch.quantile``)."""
    top = (n.double() - 1).clamp_min(0)
    rank = qs * top
    lo = rank.floor()
    return lo, (lo + 1).minimum(top), rank - lo


def _from_counts(cum: torch.Tensor, values: torch.Tensor, n: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Quantiles [Q] of ``n`` items binned by counts whose cumulative sum is ``cum`` [K] float64, each
    bin represented by ``values`` [K]."""
    lo, hi, frac = _quantiles(n, qs)
    v = values[torch.searchsorted(cum, torch.stack([lo, hi]), right=True).clamp_max(cum.numel() - 1)]
    return torch.where(n > 0, v[0] + frac * (v[1] - v[0]), torch.nan)


def token_core(mask: torch.Tensor, trainer_logp: torch.Tensor | None, sampler_logp: torch.Tensor | None,
               version: torch.Tensor | None, trainer_version: torch.Tensor, thresholds: torch.Tensor,
               abs_mids: torch.Tensor, bucket_index: torch.Tensor, qs: torch.Tensor,
               exact_quantiles: bool, over_from: torch.Tensor) -> torch.Tensor:
    """Every token-level sum of one step, packed as :func:`layout` says (float64 [size]).

    trainer_version: 0-d float64. thresholds: float64 [11] = (C - 1, 1/C - 1, low - 1, high - 1,
    log 0.1, log 0.5, log 0.9 (the probability band edges, any number of them), log C, -log C,
    log low, log high) where C is the TIS cap and [low, high] the MIS band. abs_mids: float64
    midpoints of the |r| histogram bins; bucket_index: int64 lags at the histogram bucket bounds; qs: float64 (0.5, 0.99). ``exact_quantiles`` picks a
    sort for |r| quantiles (small steps) instead of the bit-pattern histogram; ``over_from`` (0-d float64) is
    the smallest lag above the staleness bound.
    """
    per_seq = mask.sum(-1)                                                    # [B] float32
    tokens = per_seq.sum()
    parts: list[torch.Tensor] = [tokens.double().reshape(1)]
    if trainer_logp is not None and sampler_logp is not None:
        parts += _mismatch_block(mask, trainer_logp, sampler_logp, tokens, thresholds, abs_mids, qs, exact_quantiles)
    if version is not None:
        parts.append(_lag_block(version, trainer_version, mask, per_seq, bucket_index, qs, over_from))
    # 1 when this ran as compiled code, 0 eagerly (a guard that fails on the step's thread runs eagerly).
    parts.append(tokens.new_full((1,), 1.0 if torch.compiler.is_compiling() else 0.0))
    return torch.cat(parts)


def _lag_block(version: torch.Tensor, trainer_version: torch.Tensor, mask: torch.Tensor, per_seq: torch.Tensor,
               bucket_index: torch.Tensor, qs: torch.Tensor, over_from: torch.Tensor) -> torch.Tensor:
    B, T = mask.shape
    device = mask.device
    n_mask = per_seq.sum().double()
    has = per_seq > 0
    counts = torch.zeros(LAG_SIZE, dtype=torch.int64, device=device)
    if version.dim() == 2 and version.shape == mask.shape:
        lag1 = (trainer_version.float() + 1.0 - version.float()) * mask                  # lag + 1, 0 off mask
        counts = _count_into(counts, lag1.clamp(0.0, float(LAG_SIZE - 1)).int())
        negative = counts[0].double() - (B * T - n_mask)
        if T:
            seq_max = lag1.amax(-1) - 1.0
            big = float(LAG_SIZE) * 4.0
            seq_min = (lag1 - big * mask).amin(-1) + big - 1.0
        else:
            seq_max = seq_min = torch.full((B,), -1.0, device=device)
        spans = ((seq_max > seq_min) & has).double()
        seq_max = torch.where(has, seq_max, 0.0).double()
    else:
        if version.dim() == 2:
            first, last = version[:, 0], version[:, 1]
            spans = ((last != first) & has).double()
        else:
            first = version.reshape(-1)
            spans = torch.zeros(B, dtype=torch.float64, device=device)
        seq_lag = trainer_version - first.double()                                    # [B]
        idx = torch.where(has, (seq_lag + 1.0).clamp(0, LAG_SIZE - 1).long(), 0)
        counts = _count_into(counts, idx, per_seq)
        negative = ((seq_lag < 0).double() * per_seq.double()).sum()
        seq_max = torch.where(has, seq_lag, 0.0)
    histd = counts[1:].double()                                               # lags 0 .. LAG_EXACT_MAX
    lag_values = torch.arange(histd.numel(), device=device, dtype=torch.float64)
    # The lag sum and the tokens above the staleness bound in one product.
    lag_sums = (histd * torch.stack([lag_values, (lag_values >= over_from).double()])).sum(-1)
    lag_max = seq_max.amax() if B else torch.zeros((), dtype=torch.float64, device=device)
    n_ok = n_mask - negative
    hasd = has.double()
    seq_sums = torch.stack([hasd, seq_max.clamp_min(0), spans]).mul(hasd).sum(-1)
    cum = histd.cumsum(0)
    p99 = _from_counts(cum, lag_values, n_ok, qs[1:])
    return torch.cat([negative.reshape(1), lag_sums[:1], lag_max.reshape(1), n_ok.reshape(1), lag_sums[1:], seq_sums,
                      p99, cum[bucket_index]])


def _mismatch_block(mask: torch.Tensor, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
                    tokens: torch.Tensor, thresholds: torch.Tensor, abs_mids: torch.Tensor, qs: torch.Tensor,
                    exact_quantiles: bool) -> list[torch.Tensor]:
    """The mismatch block of :func:`token_core` (``MISMATCH_FIELDS`` then the bands), as parts."""
    B, T = mask.shape
    n_all = B * T
    device = mask.device
    work = torch.float64 if trainer_logp.dtype == torch.float64 else torch.float32
    r = trainer_logp.to(work) - sampler_logp.to(work)
    finite = torch.isfinite(r)
    valid = (mask * finite).to(work)                                      # masked and finite: 0/1
    r = torch.where(finite, r, 0.0) * mask                                # 0 off the valid set
    a = r.abs()
    max_a = a.amax() if n_all else torch.zeros((), dtype=work, device=device)
    em1 = r.clamp(-SAFETY_BOUND, SAFETY_BOUND).expm1()                    # w - 1, 0 off the valid set
    thr = thresholds.to(work)
    em1_t = torch.minimum(em1, thr[0])                                    # min(w, C) - 1
    keep = valid > 0
    s = torch.where(keep, sampler_logp.to(work), 0.0)                     # log mu on valid tokens (finite there)
    # Per-token columns reduced together: one pass over the tokens once compiled.
    sums = _sums([valid, r, r * r, a, em1 - r, em1, em1 * em1, em1_t, em1_t * em1_t, r * s, s * s, s])
    # w against the four IS thresholds (exact, strict): high, low, MIS below, MIS above (int64).
    t_high, t_low, t_lo, t_hi = thr[:4].unbind()
    counts = torch.stack([em1 > t_high, em1 < t_low, em1 < t_lo, em1 > t_hi]).sum((1, 2))
    # Sampler-probability bands: band k holds log mu in [edge k-1, edge k).
    edges = thr[4:-4]
    band = (s.unsqueeze(-1) >= edges).sum(-1, keepdim=True)               # [B, T, 1] 0 .. bands-1 (not
    # bucketize: its CPU kernel goes multi-threaded from 200 elements, slow on a busy host)
    band_sums = _band_sums(torch.stack([a, valid], -1).unsqueeze(-1), band, edges.numel() + 1)    # [2, bands]
    # Sequence level: s_b = sum_t r over sequences with at least one valid token.
    seq_r = r.sum(-1).double()
    has = (valid.sum(-1) > 0).double()
    seq_abs = seq_r.abs()
    log_cap, neg_log_cap, log_lo, log_hi = thresholds[-4:].unbind()
    terms = torch.stack([has, seq_abs, torch.expm1(2 * seq_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)),
                         seq_r > log_cap, seq_r < neg_log_cap, seq_r < log_lo, seq_r > log_hi])   # float64
    seq_sums = (terms * has).sum(-1)                                      # [7]
    seq_max = (seq_abs * has).amax() if B else seq_abs.sum()
    n = sums[0]
    q = _abs_quantiles(a, valid, n, max_a, abs_mids, qs, exact_quantiles or n_all == 0)
    # Smallest and largest r over the valid tokens (the importance ratio's min and max, exp on the host).
    if n_all:
        r_range = torch.stack([torch.where(keep, r, torch.inf).amin(), torch.where(keep, r, -torch.inf).amax()])
    else:
        r_range = torch.zeros(2, dtype=work, device=device)
    # torch.cat promotes every part to float64 (exactly: float32 and int64 counts fit).
    return [(tokens - n).reshape(1), sums[:4], max_a.reshape(1), sums[4:9], counts, sums[9:],
            seq_sums[:5], seq_sums[5:6] + seq_sums[6:7], seq_max.reshape(1), q, r_range,
            band_sums.t().reshape(-1)]


def _band_sums(values: torch.Tensor, band: torch.Tensor, bands: int) -> torch.Tensor:
    """Sums [2, bands] of ``values`` [B, T, 2, 1] by ``band`` [B, T, 1] (int64 in [0, bands)).
    Compiled: a product with the one-hot matrix, fused into the reduction. Eagerly: the same
    [B, T, 2, bands] terms written by one scatter into zeros (half the time of the broadcast
    product) and summed in the same order, so both give the same bits."""
    if torch.compiler.is_compiling():
        one_hot = band == torch.arange(bands, device=band.device)                       # [B, T, bands]
        return (values * one_hot.unsqueeze(-2)).sum((0, 1))
    B, T = band.shape[:2]
    terms = values.new_zeros(B, T, 2, bands).scatter_(-1, band.unsqueeze(-1).expand(B, T, 2, 1), values)
    return terms.sum((0, 1))


def _abs_quantiles(a: torch.Tensor, valid: torch.Tensor, n: torch.Tensor, max_a: torch.Tensor,
                   abs_mids: torch.Tensor, qs: torch.Tensor, exact_quantiles: bool) -> torch.Tensor:
    """|r| quantiles [Q] float64: a sort on small steps, else the float32 bit-pattern histogram."""
    n_all, device, work = a.numel(), a.device, a.dtype
    if exact_quantiles:
        if n_all == 0:
            q = torch.full((2,), torch.nan, dtype=torch.float64, device=device)
        else:
            # |r| >= +0 everywhere and 0 off the valid set: its bit patterns sort as its values, with
            # the n_all - n off-set zeros first (an integer sort is cheaper than a float one).
            bits = a.reshape(-1).view(torch.int32 if work == torch.float32 else torch.int64)
            ordered = bits.sort().values.view(work)
            lo, hi, frac = _quantiles(n, qs)
            at = (torch.stack([lo, hi]) + (n_all - n.double())).clamp_max(n_all - 1)
            v = ordered[at.long()].double()
            q = torch.where(n > 0, v[0] + frac * (v[1] - v[0]), torch.nan)
    else:
        a32 = a if work == torch.float32 else a.clamp(max=float(torch.finfo(torch.float32).max)).float()
        bins = torch.bitwise_right_shift(a32.view(torch.int32), ABS_SHIFT)            # 0 .. 65535
        every = _count_into(torch.zeros(1 << (31 - ABS_SHIFT), dtype=torch.int64, device=device), bins)
        last = ABS_FIRST + ABS_NBINS - 2
        hist = torch.cat([every[:ABS_FIRST].sum().reshape(1), every[ABS_FIRST:last], every[last:].sum().reshape(1)])
        hist = torch.cat([hist[:1] - (n_all - n.double()).round().long(), hist[1:]])   # bin 0: off-set zeros
        values = torch.cat([torch.zeros(1, dtype=torch.float64, device=device), abs_mids,
                            max_a.double().reshape(1)])
        q = _from_counts(hist.double().cumsum(0), values, n, qs)
    return q


def step_core(mask: torch.Tensor, trainer_logp: torch.Tensor | None, sampler_logp: torch.Tensor | None,
              version: torch.Tensor | None, trainer_version: torch.Tensor, thresholds: torch.Tensor,
              abs_mids: torch.Tensor, bucket_index: torch.Tensor, qs: torch.Tensor,
              ok: torch.Tensor | None, rewards: torch.Tensor | None, group_ids: torch.Tensor | None,
              env_index: torch.Tensor | None, env_slots: torch.Tensor | None, truncated: torch.Tensor | None,
              hacked: torch.Tensor | None, bounds: torch.Tensor | None,
              exact_quantiles: bool, over_from: torch.Tensor) -> torch.Tensor:
    """:func:`token_core`'s vector, then (when ``ok`` is given) the episode block of
    :func:`rlwatch.signals.episodes.episode_core`: the whole step in one function, one vector."""
    from .episodes import episode_core

    tokens = token_core(mask, trainer_logp, sampler_logp, version, trainer_version, thresholds, abs_mids,
                        bucket_index, qs, exact_quantiles, over_from)
    if ok is None or bounds is None:
        return tokens
    episodes = episode_core(mask.sum(-1), ok, rewards, group_ids, env_index, env_slots, truncated, hacked,
                            bounds, qs)
    return torch.cat([tokens, episodes])
