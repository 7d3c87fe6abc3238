"""The per-token signals as one pure tensor function, shaped for ``torch.compile``.

:func:`token_core` computes every token-level quantity of a step (mismatch, importance sampling,
|r| quantiles, probability bands, version lag) and returns them packed in one float64 vector whose
layout :func:`layout` describes, so a step's device work ends in a single host transfer.

It has no host synchronisation, no data-dependent shape and no Python branch on tensor values:
``torch.compile(token_core, fullgraph=True, dynamic=True)`` traces it without a graph break, and
inductor fuses its elementwise passes and reductions into a few kernels. Eagerly it is also the
cheapest path for small steps, where each operation costs a few microseconds of dispatch whatever
its size: the per-token quantities are written as rows of one stacked [K, B, T] buffer (counts as
0/1 rows of it) and reduced by one sum, the sequence-level terms form one [K, B] matrix, and the
ratios, the "no valid token" cases and the negative-lag count are finished on the host from the sums.
Histograms use integer counts (bincount on CPU, int64 scatter-adds elsewhere, never float atomics).

Shapes: ``mask`` [B, T] float32 0/1; log-probs [B, T] any float dtype; ``version`` [B, T], [B]
or [B, 2]. Thresholds arrive as small tensors (not Python numbers) so that a new configuration
does not recompile.
"""

from __future__ import annotations

from typing import Callable

import torch

from .reduce import ABS_FIRST, ABS_NBINS, ABS_SHIFT, count_into
from .settings import LAG_EXACT_MAX, SAFETY_BOUND

LAG_SIZE = LAG_EXACT_MAX + 2            # bin k holds lag k - 1; bin 0 off-mask and negative lags
LAG_BINS = LAG_EXACT_MAX + 1            # the histogram of lags 0 .. LAG_EXACT_MAX

# Float32 sums of 0/1 rows are exact up to 2**24 positions; larger eager steps take the compiled
# branch (float64 sums).
_EXACT_F32_COUNT = 1 << 24

#: Names of the mismatch block, in the order :func:`_mismatch_block` produces them: sums over the
#: valid tokens of 1, r, s = log mu, w - 1, min(w, C) - 1, |r|, k3 terms, r s, then of their squares
#: (``n_sq`` = n; ``sq_a``, ``sq_k3``, ``sq_rs`` unused), counts against the IS thresholds, and
#: ``band_abs`` and ``band_positions``, slices: |r| sums and positions per sampler-probability band
#: (positions off the valid set have s = 0, in the last band, so every band but the last counts
#: valid tokens only). ``neg_min_r`` is minus the smallest valid r. Without valid tokens (n = 0)
#: the sums are 0 and the maxima -inf: the host formulas read n first.
MISMATCH_FIELDS = (
    "n", "sum_r", "s_sum", "sum_em1", "sum_em1t", "sum_a", "sum_k3", "rs",
    "n_sq", "sum_r2", "ss", "sq_em1", "sq_em1t", "sq_a", "sq_k3", "sq_rs",
    "high", "low", "mis_below", "mis_above", "band_abs", "band_positions", "max_r", "neg_min_r", "max_a",
    "seq_n", "seq_abs", "seq_chi2", "seq_high", "seq_low", "seq_mis_below", "seq_mis_above", "seq_max",
    "q50", "q99",
)
#: Names of the lag block, in order (``lag_cum``: the cumulative counts at the histogram buckets;
#: ``n_ok`` the tokens of non-negative lag (the negative ones are the mask's other tokens);
#: ``cum_sum`` the sum of the LAG_BINS cumulative counts, LAG_BINS * n_ok minus the lag sum).
LAG_FIELDS = ("lag_cum", "n_ok", "cum_sum", "over", "lag_p50", "lag_p99", "lag_seq_n", "lag_seq_max_sum", "spans",
              "lag_max")
_SLICES = ("band_abs", "band_positions", "lag_cum")


def layout(mismatch: bool, lag: bool, bands: int, buckets: int) -> dict[str, int | slice]:
    """Positions in :func:`token_core`'s output: ``tokens`` first, then the mismatch block
    (``band_abs`` and ``band_positions`` slices of ``bands`` values), the lag block (``lag_cum`` a slice
    of ``buckets`` values), and last ``compiled`` (1 when compiled code produced the vector)."""
    at, pos = 1, {"tokens": 0}
    names = (MISMATCH_FIELDS if mismatch else ()) + (LAG_FIELDS if lag else ())
    for name in names:
        width = (buckets if name == "lag_cum" else bands) if name in _SLICES else 0
        if width:
            pos[name], at = slice(at, at + width), at + width
        else:
            pos[name], at = at, at + 1
    pos["compiled"], at = at, at + 1
    pos["size"] = at
    return pos


_CACHE: dict[tuple, torch.Tensor] = {}


def _cached(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A small constant tensor made once per process and key when eager (one operation less per
    step); compiled code makes it inline (a constant of the graph)."""
    if torch.compiler.is_compiling():
        return make()
    tensor = _CACHE.get(key)
    if tensor is None:          # read-only, so one made in inference mode serves outside it too
        tensor = _CACHE[key] = make()
    return tensor


def _signs(dtype: torch.dtype, device: torch.device, dims: int) -> torch.Tensor:
    """(1, -1, -1, 1) shaped [4, 1 ...] (``dims`` dimensions): x against thresholds t as (x - t) * sign
    > 0 gives x > t, x < t, x < t, x > t, exactly (x - t is 0 only where x == t, and keeps its sign)."""
    return _cached(("signs", dtype, device, dims), lambda: torch.tensor(
        (1.0, -1.0, -1.0, 1.0), dtype=dtype, device=device).view((4,) + (1,) * (dims - 1)))


def _eager_rows(n_all: int) -> bool:
    """Whether per-token rows are stacked into one buffer and reduced by one sum (eager steps whose
    0/1 rows sum exactly in float32), rather than reduced one by one (compiled: inductor fuses the
    reductions without materialising the rows)."""
    return not torch.compiler.is_compiling() and n_all <= _EXACT_F32_COUNT


# CPU reductions over this many elements or more go to the thread pool, which wakes other threads for
# microseconds of work (and stalls for milliseconds on a busy host).
_SERIAL = 32768


def _row_sums(rows: torch.Tensor) -> list[torch.Tensor]:
    """Sums over the positions of each row of ``rows`` [K, B, T], as parts [k] (one for up to
    _SERIAL elements, else in chunks of rows that each stay in one thread)."""
    if rows.numel() < _SERIAL or rows.device.type != "cpu":
        return [rows.sum((1, 2))]
    K, flat = rows.shape[0], rows.reshape(rows.shape[0], -1)
    step = max(1, (_SERIAL - 1) // max(flat.shape[1], 1))
    return [flat[i:i + step].sum(-1) for i in range(0, K, step)]


def _ranks(n: torch.Tensor, qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The order statistics [2, Q] (0-based, float64) that each ``qs``-quantile of ``n`` items lies
    between, and its position between them [Q] (linear interpolation, as ``torch.quantile``; the upper
    one equals the lower where the rank is whole, which interpolates to the same value). With n = 0
    the ranks are negative (indices from the end, a value the host ignores)."""
    rank = qs * (n - 1)
    low = rank.floor()
    return torch.stack([low, rank.ceil()]), rank - low


def _interpolate(pairs: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """Values [Q] between the order statistics ``pairs`` [2, Q] (float64), as ``torch.quantile``."""
    low, high = pairs.unbind()
    return torch.lerp(low, high, frac)


def _lag_hist(lag1: torch.Tensor) -> torch.Tensor:
    """Tokens by lag 0 .. LAG_EXACT_MAX [LAG_EXACT_MAX + 1] (larger lags in the last bin) from lag + 1
    per token (<= 0 off the mask and for negative lags: not counted), as integers. (Not histc: on
    CPU it costs ~1.4 ms for any input.)"""
    return count_into(LAG_SIZE, lag1.clamp(0.0, float(LAG_SIZE - 1)).int())[1:]


def token_core(mask: torch.Tensor, trainer_logp: torch.Tensor | None, sampler_logp: torch.Tensor | None,
               version: torch.Tensor | None, trainer_version: torch.Tensor, thresholds: torch.Tensor,
               abs_mids: torch.Tensor, bucket_index: torch.Tensor, qs: torch.Tensor,
               exact_quantiles: bool, over_from: torch.Tensor) -> torch.Tensor:
    """Every token-level sum of one step, packed as :func:`layout` says (float64 [size]).

    trainer_version: 0-d float64. thresholds: float64 [11] = (C - 1, 1/C - 1, low - 1, high - 1,
    log 0.1, log 0.5, log 0.9 (the probability band edges, any number of them), log C, -log C,
    log low, log high) where C is the TIS cap and [low, high] the MIS band. abs_mids: float64
    midpoints of the |r| histogram bins; bucket_index: int64 lags at the histogram bucket bounds;
    qs: float64 (0.5, 0.99). ``exact_quantiles`` picks a sort for |r| quantiles (small steps) instead
    of the bit-pattern histogram; ``over_from`` (0-d float64) is the smallest lag above the
    staleness bound.
    """
    per_seq = mask.sum(-1)                                                    # [B] float32
    parts: list[torch.Tensor] = [per_seq.sum(0, keepdim=True, dtype=torch.float64)]     # exact: whole numbers
    lag_args = (version, trainer_version, mask, per_seq, bucket_index, qs, over_from)
    # Per-token versions: the lag block first, so that compiled, its per-sequence reductions share a
    # loop with the mask's (inductor does not fuse nodes far apart in the graph).
    lag = _lag_block(*lag_args) if version is not None and version.shape == mask.shape else None
    if trainer_logp is not None and sampler_logp is not None:
        parts += _mismatch_block(mask, trainer_logp, sampler_logp, thresholds, abs_mids, qs, exact_quantiles)
    if version is not None:
        parts += lag if lag is not None else _lag_block(*lag_args)
    # 1 when this ran as compiled code, 0 eagerly (a guard that fails on the step's thread runs
    # eagerly). Float64, so that torch.cat promotes every part to float64 (exactly: float32 sums and
    # int64 counts fit).
    device = mask.device
    parts.append(_cached(("compiled", device), lambda: torch.full((1,), 1.0 if torch.compiler.is_compiling() else 0.0,
                                                                  dtype=torch.float64, device=device)))
    return torch.cat(parts)


def _mismatch_block(mask: torch.Tensor, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
                    thresholds: torch.Tensor, abs_mids: torch.Tensor, qs: torch.Tensor,
                    exact_quantiles: bool) -> list[torch.Tensor]:
    """The mismatch block of :func:`token_core` (``MISMATCH_FIELDS``), as parts of the output."""
    B, T = mask.shape
    n_all = B * T
    device = mask.device
    work = torch.float64 if trainer_logp.dtype == torch.float64 else torch.float32
    trainer = trainer_logp if trainer_logp.dtype == work else trainer_logp.to(work)
    sampler = sampler_logp if sampler_logp.dtype == work else sampler_logp.to(work)
    r = trainer - sampler
    keep = torch.logical_and(torch.isfinite(r), mask)                     # the valid tokens: masked, finite r
    r = torch.where(keep, r, 0.0)                                         # 0 off the valid set
    s = torch.where(keep, sampler, 0.0)                                   # log mu on valid tokens (finite there)
    a = r.abs()
    em1 = r.clamp(-SAFETY_BOUND, SAFETY_BOUND).expm1()                    # w - 1, 0 off the valid set
    thr = thresholds if work == torch.float64 else thresholds.to(work)
    em1_t = em1.clamp(max=thr[0])                                         # min(w, C) - 1
    # Sampler-probability bands: band k holds log mu in [edge k-1, edge k) (not bucketize: its CPU
    # kernel goes multi-threaded from 200 elements, slow on a busy host). Off the valid set s = 0
    # falls in the last band, with |r| = 0 and no valid token.
    edges = thr[4:-4]
    bands = edges.numel() + 1
    # The rows summed over the tokens, in MISMATCH_FIELDS order: valid tokens, r, s, w - 1,
    # min(w, C) - 1, |r|, k3 terms, r s, their squares, w against the four IS thresholds (exact,
    # strict: w > C, w < 1/C, w < low, w > high), |r| and positions by band.
    if _eager_rows(n_all):
        # Eagerly: groups of rows [k, B, T] by broadcasting, one buffer, one sum.
        y = torch.stack([keep, r, s, em1, em1_t, a, em1 - r, r * s])          # [8, B, T]; then their squares
        band = (s >= edges.view(-1, 1, 1)).sum(0)                         # [B, T] 0 .. bands - 1
        in_band = band == _cached(("bands", bands, device),
                                  lambda: torch.arange(bands, device=device).view(-1, 1, 1))
        rows = torch.cat([y, y * y, (em1 - thr[:4].view(4, 1, 1)) * _signs(work, device, 3) > 0, a * in_band,
                          in_band])                                       # [K, B, T] in the work dtype
        parts = _row_sums(rows)
        per_seq = rows[:2].sum(-1)                                        # [2, B]: valid tokens, sum of r
        n = parts[0][:1]
        # Largest r, -smallest r and largest |r| over the valid tokens (-inf without any).
        if n_all:
            parts.append(torch.where(keep, torch.stack([r, -r, a]), -torch.inf).amax((1, 2)))
        else:
            parts.append(torch.zeros(3, dtype=work, device=device))
    else:
        parts, per_seq = _compiled_row_sums(keep, r, s, a, em1, em1_t, thr, edges)
        n = parts[0][:1]
    extremes = parts[-1]
    # Sequence level: s_b = sum_t r over sequences with a valid token. Without one s_b = 0, so every
    # term but the count is 0 (log C, log high > 0 > -log C, log low).
    valid_count, seq_r = per_seq.double().unbind()
    seq_abs = seq_r.abs()
    # s_b > log C, s_b < -log C, s_b < log low, s_b > log high
    against = (seq_r - thresholds[-4:].view(4, 1)) * _signs(torch.float64, device, 2) > 0
    chi2 = torch.expm1(2 * seq_r.clamp(-SAFETY_BOUND, SAFETY_BOUND))       # w_b^2 - 1
    terms = torch.cat([torch.stack([valid_count > 0, seq_abs, chi2]), against])  # [7, B] float64
    parts += [terms.sum(-1), seq_abs.amax(0, keepdim=True) if B else seq_abs.new_zeros(1)]
    parts.append(_abs_quantiles(a, keep, n, extremes, abs_mids, qs, exact_quantiles or n_all == 0))
    return parts


def _compiled_row_sums(keep: torch.Tensor, r: torch.Tensor, s: torch.Tensor, a: torch.Tensor, em1: torch.Tensor,
                       em1_t: torch.Tensor, thr: torch.Tensor,
                       edges: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The compiled branch of :func:`_mismatch_block`: the row sums [K] float64 (the rows of the eager
    branch, in the same order) and the extremes [3], as parts, and the per-sequence sums [2, B].

    One float64 sum per row (exact counts): inductor fuses reductions over the same positions into
    a few loops (two, of 15 sums each, in the C++ it generates for CPU) and never writes a row; a
    stack of the rows feeding one reduction would instead be materialised ([B, T, K] float64, 8 K
    bytes per position: several times the inputs; tests/test_engine.py forbids it)."""
    bands = edges.numel() + 1
    band = sum(s >= edges[k] for k in range(bands - 1))
    in_band = [band == k for k in range(bands)]
    k3, rs = em1 - r, r * s
    rows = [keep, r, s, em1, em1_t, a, k3, rs, keep, r * r, s * s, em1 * em1, em1_t * em1_t, a * a, k3 * k3,
            rs * rs, em1 > thr[0], em1 < thr[1], em1 < thr[2], em1 > thr[3], *(a * i for i in in_band), *in_band]
    parts = [torch.stack([row.sum(dtype=torch.float64) for row in rows]),
             torch.stack([torch.where(keep, x, -torch.inf).amax() for x in (r, -r, a)])]
    return parts, torch.stack([keep.sum(-1), r.sum(-1)])


def _abs_quantiles(a: torch.Tensor, keep: torch.Tensor, n: torch.Tensor, extremes: torch.Tensor,
                   abs_mids: torch.Tensor, qs: torch.Tensor, exact_quantiles: bool) -> torch.Tensor:
    """|r| quantiles [Q] float64 (meaningless when n = 0): a sort on small steps, else the float32
    bit-pattern histogram. a: [B, T] |r|, 0 off the valid set ``keep``; n [1]: the valid tokens;
    ``extremes``: [max r, -min r, max |r|]."""
    n_all, device, work = a.numel(), a.device, a.dtype
    lohi, frac = _ranks(n, qs)
    if exact_quantiles:
        if n_all == 0:
            return torch.zeros(qs.numel(), dtype=torch.float64, device=device)
        # |r| on the valid set, +inf off it: as non-negative floats its bit patterns sort as its
        # values (an integer sort is cheaper than a float one), the n valid ones first.
        bits = torch.where(keep, a, torch.inf).reshape(-1).view(torch.int32 if work == torch.float32 else torch.int64)
        ordered = bits.sort().values.view(work)
        return _interpolate(ordered[lohi.long()].double(), frac)
    a32 = a if work == torch.float32 else a.clamp(max=float(torch.finfo(torch.float32).max)).float()
    bins = torch.bitwise_right_shift(a32.view(torch.int32), ABS_SHIFT)               # 0 .. 65535
    every = count_into(1 << (31 - ABS_SHIFT), bins).long()
    last = ABS_FIRST + ABS_NBINS - 2
    # Bin 0: below 2^-40, less the n_all - n zeros off the valid set; the top bin: from 2^24.
    hist = torch.cat([every[:ABS_FIRST].sum(0, keepdim=True) - (n_all - n).long(), every[ABS_FIRST:last],
                      every[last:].sum(0, keepdim=True)])
    values = torch.cat([torch.zeros(1, dtype=torch.float64, device=device), abs_mids, extremes[2:].double()])
    at = torch.searchsorted(hist.cumsum(0, dtype=torch.float64), lohi, right=True).clamp_max(hist.numel() - 1)
    return _interpolate(values[at], frac)


def _lag_block(version: torch.Tensor, trainer_version: torch.Tensor, mask: torch.Tensor, per_seq: torch.Tensor,
               bucket_index: torch.Tensor, qs: torch.Tensor, over_from: torch.Tensor) -> list[torch.Tensor]:
    """The lag block of :func:`token_core` (``LAG_FIELDS``), as parts of the output."""
    B, T = mask.shape
    device = mask.device
    has = per_seq > 0
    if version.shape == mask.shape:
        if version.dtype.is_floating_point and version.dtype not in (torch.float32, torch.float64):
            version = version.float()
        lag1 = (trainer_version + 1.0 - version) * mask                # lag + 1, 0 off mask (float64 for integers)
        hist = _lag_hist(lag1)
        if T:
            big = float(LAG_SIZE) * 4.0
            top = lag1.amax(-1)                               # 1 + the largest lag of the sequence (>= 0)
            # 1 + its smallest lag, + big; big when it has no token, so no span then either.
            spans = top > (lag1 - big * mask).amin(-1) + big
        else:
            top, spans = per_seq, has
        seq_max = top - 1.0
        # A sequence without tokens (top 0) adds 0 to the sums; to the maximum it adds -1 instead of 0,
        # which changes it only when no token has a lag >= 0 (n_ok = 0: not reported).
    else:
        if version.dim() == 2:
            first, last = version.unbind(-1)
            spans = (last != first) & has
        else:
            first = version.reshape(-1)
            spans = torch.zeros_like(has)
        if first.dtype.is_floating_point and first.dtype != torch.float64:
            first = first.double()
        seq_max = trainer_version - first                                               # [B] float64
        # Sequences without tokens weigh 0 in the histogram.
        hist = count_into(LAG_SIZE, (seq_max + 1.0).clamp(0, LAG_SIZE - 1).long(), per_seq)[1:]
        seq_max = torch.where(has, seq_max, 0.0)
    # hist [LAG_EXACT_MAX + 1]: tokens by lag 0 .. LAG_EXACT_MAX (larger lags in the last bin)
    cum = hist.cumsum(0, dtype=torch.float64)
    n_ok = cum[-1:]                                                           # tokens of lag >= 0
    lags = _cached(("lags", device), lambda: torch.arange(LAG_BINS, dtype=torch.float64, device=device))
    # The sum of the lags is LAG_BINS * n_ok - sum(cum) (exact: whole numbers below 2**53).
    sums = [cum.sum(0, keepdim=True), (hist * (lags >= over_from)).sum(0, keepdim=True)]
    lohi, frac = _ranks(n_ok, qs)
    quantiles = _interpolate(torch.searchsorted(cum, lohi, right=True).double(), frac)   # bin k: lag k
    seq_sums = torch.stack([has, seq_max.clamp_min(0), spans]).sum(-1, dtype=torch.float64)
    lag_max = seq_max.amax(0, keepdim=True) if B else seq_max.new_zeros(1)
    return [cum[bucket_index], n_ok, *sums, quantiles, seq_sums, lag_max]


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
                            bounds)
    return torch.cat([tokens, episodes])
