"""Pure per-step RL health signals computed from plain tensors.

Everything here runs on the tensors' own device, vectorised, and never synchronises with the host:
each function puts 0-d or small 1-d tensors into a :class:`Pending` collection, and
:meth:`Pending.resolve` moves all of them to the host in a single transfer. Nothing materialises
a ``[batch, time, vocab]`` tensor and no Python loop runs over tokens.

Conventions (shapes: ``B`` sequences, ``T`` response positions):

- ``mask`` is a float ``[B, T]`` tensor of 0/1: the response tokens the trainer trains on.
- ``r = trainer_logp - sampler_logp`` on masked tokens (nats); ``w = exp(r) = pi_old / mu``.
- Tokens whose ``r`` is not finite are counted in ``nonfinite_tokens`` and excluded from every
  other mismatch signal, so one ``-inf`` never turns a metric into NaN.
- A ratio whose denominator is zero (no valid tokens, no groups) resolves to ``None``.

Where a definition coincides with verl's ``rollout_corr/*`` it is computed the same way, except
that ``exp`` is always taken of ``r`` clamped to [-20, 20] (verl's ``SAFETY_BOUND``, which verl
applies to chi2 and the IS weights but not to ``k3_kl``) so that a single token cannot make k3
infinite; with |r| <= 20 the two agree. k3 and chi2 use ``expm1`` instead of ``exp(r) - 1``, which
keeps them non-negative and accurate when the mismatch is tiny.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from .metrics import LAG_BUCKETS, PROB_BIN_EDGES, PROB_BIN_LABELS, ZERO_VARIANCE_KINDS

if TYPE_CHECKING:
    from .record import StepRecord

SAFETY_BOUND = 20.0  # |r| clamp before exp, as verl's rollout_corr_helper.SAFETY_BOUND

# |r| quantiles come from a histogram over the float32 bit pattern of |r|: for non-negative floats the
# bits are monotone in the value, and bits >> 15 gives 256 equal-width bins per power of two. A bin's
# midpoint is within 0.2% of any value in it. The bins span [2^-40, 2^24) nats; smaller values count
# as 0 and larger ones share the top bin, represented by the exact maximum.
_ABS_SHIFT = 15
_ABS_FIRST = (127 - 40) << 8                 # bit-pattern bin of 2^-40
_ABS_NBINS = ((127 + 24) << 8) - _ABS_FIRST + 2   # + the zero bin and the top bin

# Lag percentiles and the lag mean are exact up to this many updates; larger lags count as this
# many (the maximum stays exact).
_LAG_EXACT_MAX = 4095

# Exact strict comparisons without boolean tensors: (x - t) * 2**64 is >= 1 in magnitude whenever
# x != t (for |t| > 2**-60), so clamping it to [0, 1] gives the 0/1 indicator of x > t.
_SCALE = 2.0 ** 64

@dataclass(frozen=True)
class SignalConfig:
    """Thresholds the signals are computed against.

    staleness_bound: lag (policy updates) above which a token counts as over-stale.
    is_cap: truncated-IS cap C; tokens with w > C are truncated, w < 1/C counted as low.
    mis_band: masked-IS band [low, high]; tokens with w outside it are masked.
    reward_bounds: (fail, pass) rewards that classify constant groups; inferred per batch if None.
    group_size: expected episodes per group (e.g. num_generations), checked when given.
    """

    staleness_bound: float = 4.0
    is_cap: float = 2.0
    mis_band: tuple[float, float] = (0.5, 5.0)
    reward_bounds: tuple[float, float] | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        if not self.is_cap > 1.0:
            raise ValueError(f"is_cap must be > 1, got {self.is_cap}")
        low, high = self.mis_band
        if not 0.0 < low < 1.0 < high:
            raise ValueError(f"mis_band must satisfy 0 < low < 1 < high, got {self.mis_band}")
        if self.staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {self.staleness_bound}")


class Pending:
    """Device tensors waiting for the step's single host transfer.

    ``put(name, value, labels)`` stores a scalar; ``put_vector(name, tensor, label_rows)`` stores one
    value per label row. ``resolve()`` returns ``{name: {labels: float | None}}`` with NaN and
    infinities mapped to None.
    """

    def __init__(self) -> None:
        self._scalars: list[tuple[str, tuple[str, ...]]] = []
        self._scalar_tensors: list[torch.Tensor] = []
        self._vectors: list[tuple[str, list[tuple[str, ...]]]] = []
        self._vector_tensors: list[torch.Tensor] = []

    def put(self, name: str, value: torch.Tensor | float, labels: tuple[str, ...] = ()) -> None:
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value), dtype=torch.float64)
        self._scalars.append((name, labels))
        self._scalar_tensors.append(value.reshape(()) if value.dim() else value)

    def put_vector(self, name: str, values: torch.Tensor, label_rows: Sequence[tuple[str, ...]]) -> None:
        values = values.reshape(-1)
        if values.numel() != len(label_rows):
            raise ValueError(f"{name}: {values.numel()} values for {len(label_rows)} label rows")
        self._vectors.append((name, list(label_rows)))
        self._vector_tensors.append(values)

    def resolve(self) -> dict[str, dict[tuple[str, ...], float | None]]:
        tensors = ([torch.stack(self._scalar_tensors)] if self._scalar_tensors else []) + self._vector_tensors
        if not tensors:
            return {}
        if len({t.device for t in tensors}) > 1:
            tensors = [t.cpu() for t in tensors]
        host = torch.cat(tensors).to(torch.float64).tolist()   # the one host synchronisation of the step
        out: dict[str, dict[tuple[str, ...], float | None]] = {}
        values = iter(host)
        for name, labels in self._scalars:
            v = next(values)
            out.setdefault(name, {})[labels] = v if math.isfinite(v) else None
        for name, rows in self._vectors:
            family = out.setdefault(name, {})
            for labels in rows:
                v = next(values)
                family[labels] = v if math.isfinite(v) else None
        return out


# --- small vectorised helpers -----------------------------------------------------------------

def _count_gt(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Number of elements strictly greater than ``threshold`` (float arithmetic, no bool tensor)."""
    return (x - threshold).sign_().clamp_min_(0).sum()


def _count_lt(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Number of elements strictly less than ``threshold``."""
    return (threshold - x).sign_().clamp_min_(0).sum()


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.reshape(-1), b.reshape(-1)
    if a.numel() < 65536:
        # BLAS dot wakes its thread pool even for a few thousand elements, which stalls for a whole
        # scheduler time slice on a busy host; small products stay in one thread this way.
        return (a * b).sum()
    return torch.dot(a, b)


def _nonfinite_indicator(x: torch.Tensor) -> torch.Tensor:
    """1.0 where ``x`` is NaN or infinite, else 0.0 (x - x is NaN exactly there)."""
    return (x - x).nan_to_num_(nan=1.0)


def quantile_from_counts(counts: torch.Tensor, values: torch.Tensor, n: torch.Tensor,
                         q: float, cum: torch.Tensor | None = None) -> torch.Tensor:
    """q-quantile (linear interpolation between order statistics, as ``torch.quantile``) of
    ``n`` items binned by ``counts`` [K], each bin represented by ``values`` [K]. No host sync.
    ``cum`` may pass ``counts.cumsum(0)`` when several quantiles share it."""
    cum = counts.cumsum(0) if cum is None else cum
    rank = q * (n - 1).clamp_min(0)
    lo_rank = rank.floor()
    hi_rank = (lo_rank + 1).minimum((n - 1).clamp_min(0))
    frac = rank - lo_rank
    last = counts.numel() - 1
    lo_bin = torch.searchsorted(cum, lo_rank.reshape(1), right=True).clamp_max(last)
    hi_bin = torch.searchsorted(cum, hi_rank.reshape(1), right=True).clamp_max(last)
    v_lo, v_hi = values[lo_bin].reshape(()), values[hi_bin].reshape(())
    result = v_lo + frac * (v_hi - v_lo)
    return torch.where(n > 0, result, torch.full_like(result, float("nan")))


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den in float64. Every denominator here counts the items its numerator sums over, so an
    empty set gives 0/0 = NaN, which resolves to None."""
    return num.double() / den


def _sorted_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile-compatible q-quantile of a small 1-D tensor whose length is known on host."""
    n = values.numel()
    if n == 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    s = values.sort().values
    rank = q * (n - 1)
    lo = int(math.floor(rank))
    hi = min(lo + 1, n - 1)
    return s[lo] + (rank - lo) * (s[hi] - s[lo])


class Workspace:
    """Scratch buffers reused across steps, keyed by name.

    A fresh multi-megabyte CPU tensor page-faults on first touch, which costs more than the
    arithmetic on it; reusing buffers of the same shape makes every step after the first allocate
    nothing. One workspace belongs to one caller at a time (``Watch`` holds a lock).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


# --- mismatch and importance sampling ----------------------------------------------------------

def bin_counts(index: torch.Tensor, size: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Counts (or weight sums) of ``index`` values in [0, size), float64 [size], without a host sync.

    ``torch.bincount`` sizes its output from the data, which synchronises on accelerators; there a
    scatter-add into a fixed-size tensor is used instead. Indices must already lie in [0, size).
    """
    index = index.reshape(-1)
    if index.device.type == "cpu":
        w = None if weights is None else weights.reshape(-1).to(torch.float64)
        return torch.bincount(index, weights=w, minlength=size).to(torch.float64)[:size]
    src = (torch.ones_like(index, dtype=torch.float64) if weights is None
           else weights.reshape(-1).to(torch.float64))
    return torch.zeros(size, dtype=torch.float64, device=index.device).scatter_add_(0, index.long(), src)


_ABS_VALUES: dict[torch.device, torch.Tensor] = {}


def _abs_bin_values(device: torch.device, max_abs: torch.Tensor) -> torch.Tensor:
    """Representative value of each |r| bin: 0, the midpoints of [2^-40, 2^24), then the exact max."""
    mids = _ABS_VALUES.get(device)
    if mids is None:
        k = torch.arange(_ABS_FIRST, _ABS_FIRST + _ABS_NBINS - 1, dtype=torch.int64)
        edges = (k << _ABS_SHIFT).to(torch.int32).view(torch.float32).to(torch.float64)
        mids = _ABS_VALUES[device] = ((edges[:-1] + edges[1:]) / 2).to(device)
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    return torch.cat([zero, mids, max_abs.double().reshape(1)])


def mismatch_signals(out: Pending, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
                     mask: torch.Tensor, config: SignalConfig, ws: Workspace | None = None,
                     tokens: torch.Tensor | None = None) -> None:
    """Sampler-learner mismatch and importance-sampling health.

    trainer_logp, sampler_logp: [B, T] log-probs of the sampled tokens (nats); mask: [B, T] float 0/1;
    tokens: mask.sum() if the caller has it.
    """
    ws = ws or Workspace()
    shape, device = mask.shape, mask.device
    work = torch.float64 if trainer_logp.dtype == torch.float64 else torch.float32

    def buf(name: str, dtype: torch.dtype = work) -> torch.Tensor:
        return ws.get(name, shape, dtype, device)

    # r and (later) the masked sampler log-probs side by side: one matrix-vector product gives the
    # slope's two dot products.
    r_and_s = ws.get("r_s", (2, *shape), work, device)
    r = r_and_s[0]
    if trainer_logp.dtype == work and sampler_logp.dtype == work:
        torch.sub(trainer_logp, sampler_logp, out=r)                         # [B, T]
    else:
        r.copy_(trainer_logp).sub_(sampler_logp.to(work))
    # |r| and the valid mask side by side in one buffer: the probability bands below read both with
    # one matrix-vector product per band.
    pair = ws.get("a_valid", (2, *shape), work, device)
    a_buf, valid = pair[0], pair[1]
    torch.sub(r, r, out=valid).nan_to_num_(nan=1.0).mul_(mask)               # 1 on masked non-finite
    nonfinite = valid.sum()
    torch.sub(mask, valid, out=valid)                                         # masked and finite: 0/1
    r.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(mask)                # 0 off the valid set
    n_all = r.numel()
    n = (mask.sum() if tokens is None else tokens) - nonfinite
    out.put("nonfinite_tokens", nonfinite)
    out.put("nonfinite_tokens_total", nonfinite)
    out.put("mismatch_tokens", n)
    out.put("mismatch_tokens_total", n)

    # First and second moments of r and |r|.
    sum_r = r.sum()
    out.put("mismatch_log_ratio_mean", _safe_div(sum_r, n))
    out.put("mismatch_kl_k1", _safe_div(-sum_r, n))
    out.put("mismatch_kl_k2", _safe_div(0.5 * _dot(r, r), n))
    a = torch.abs(r, out=a_buf)
    max_a = a.amax() if n_all else torch.zeros((), dtype=work, device=device)
    sum_a = a.sum()
    out.put("mismatch_abs_log_ratio_mean", _safe_div(sum_a, n))
    out.put("mismatch_abs_log_ratio_max", torch.where(n > 0, max_a.double(), torch.nan))

    # w - 1 = expm1(r) with |r| clamped; 0 off the valid set, so every sum below is over valid tokens.
    em1 = torch.clamp(r, -SAFETY_BOUND, SAFETY_BOUND, out=buf("em1")).expm1_()
    tmp = buf("tmp")
    out.put("mismatch_kl_k3", _safe_div(torch.sub(em1, r, out=tmp).sum(), n))
    sum_em1, sq_em1 = em1.sum().double(), _dot(em1, em1).double()
    out.put("mismatch_chi2_token", _safe_div(sq_em1 + 2 * sum_em1, n))        # mean(w^2 - 1)
    n64 = n.double()
    sum_w, sum_w2 = n64 + sum_em1, n64 + sq_em1 + 2 * sum_em1
    # (sum w)^2 <= N sum w^2 (Cauchy-Schwarz); the clamp only removes float rounding above 1.
    out.put("is_ess_raw_ratio", _safe_div(sum_w * sum_w, n64 * sum_w2).clamp(max=1.0))
    cap = config.is_cap
    em1_t = torch.clamp(em1, max=cap - 1.0, out=tmp)                          # min(w, C) - 1
    st, st2 = em1_t.sum().double(), _dot(em1_t, em1_t).double()
    sum_wt, sum_wt2 = n64 + st, n64 + st2 + 2 * st
    out.put("is_ess_ratio", _safe_div(sum_wt * sum_wt, n64 * sum_wt2).clamp(max=1.0))

    # Threshold counts on w, exact and strict (see _SCALE): w > C, w < 1/C, w outside the MIS band.
    scaled = torch.mul(em1, _SCALE, out=em1)
    counted: dict[tuple[str, float], torch.Tensor] = {}

    def count(side: str, threshold: float) -> torch.Tensor:   # thresholds are often shared (1/C = low)
        key = (side, threshold)
        if key not in counted:
            diff = torch.sub(scaled, threshold * _SCALE, out=tmp)
            counted[key] = diff.clamp_(0.0, 1.0).sum() if side == ">" else -diff.clamp_(-1.0, 0.0).sum()
        return counted[key]

    mis_low, mis_high = config.mis_band
    high, low = count(">", cap - 1.0), count("<", 1.0 / cap - 1.0)
    mis = count("<", mis_low - 1.0) + count(">", mis_high - 1.0)
    out.put("is_tis_high_ratio", _safe_div(high, n))
    out.put("is_tis_low_ratio", _safe_div(low, n))
    out.put("is_mis_masked_ratio", _safe_div(mis, n))
    out.put("is_tis_truncated_tokens_total", high)
    out.put("is_mis_masked_tokens_total", mis)

    # Slope of r against log mu over valid tokens (a temperature mismatch makes r linear in log mu).
    s_valid = torch.mul(sampler_logp, valid, out=r_and_s[1]).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    rs, s_sq = torch.mv(r_and_s.view(2, -1), s_valid.reshape(-1)).double()
    s_sum = s_valid.sum().double()
    var_s = n64 * s_sq - s_sum * s_sum
    slope = torch.where(var_s > 1e-9 * n64 * n64, (n64 * rs - s_sum * sum_r.double()) / var_s.clamp_min(1e-300),
                        torch.full_like(var_s, float("nan")))
    out.put("mismatch_log_ratio_slope", slope)
    neg_s = torch.mul(s_valid, -_SCALE, out=em1)          # -log mu scaled, for the probability bands below

    # Sequence level: s_b = sum_t r, weight exp(s_b), over sequences with at least one valid token.
    seq_r = r.sum(-1).double()                                                # [B]
    has = (valid.sum(-1) > 0).to(torch.float64)                               # [B]
    n_seq = has.sum()
    seq_abs = seq_r.abs()
    out.put("mismatch_seq_log_ratio_abs_mean", _safe_div(_dot(seq_abs, has), n_seq))
    out.put("mismatch_seq_log_ratio_abs_max",
            torch.where(n_seq > 0, (seq_abs * has).amax() if seq_abs.numel() else seq_abs.sum(), torch.nan))
    seq_c = seq_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out.put("mismatch_chi2_sequence", _safe_div(_dot(torch.expm1(2 * seq_c), has), n_seq))
    log_cap = math.log(cap)
    out.put("is_seq_tis_high_ratio", _safe_div(_dot((seq_r > log_cap).double(), has), n_seq))
    out.put("is_seq_tis_low_ratio", _safe_div(_dot((seq_r < -log_cap).double(), has), n_seq))
    seq_out = (seq_r < math.log(mis_low)) | (seq_r > math.log(mis_high))
    out.put("is_seq_mis_masked_ratio", _safe_div(_dot(seq_out.double(), has), n_seq))

    # Mean |r| by sampler probability: dot products with the 0/1 indicator of each probability band
    # (computed per band rather than as differences of cumulative sums, which lose float32 precision).
    below, previous, band = tmp, r, r_and_s[1]             # r and s_valid are no longer needed
    bin_sums, bin_count = [], []
    for i, edge in enumerate((*PROB_BIN_EDGES, None)):
        if edge is not None:
            torch.add(neg_s, math.log(edge) * _SCALE, out=below).clamp_(0.0, 1.0)   # [log mu < log edge]
            indicator = below if i == 0 else torch.sub(below, previous, out=band)
        else:
            indicator = previous.neg_().add_(1.0)                              # [log mu >= last edge]
        sum_and_count = torch.mv(pair.view(2, -1), indicator.reshape(-1))    # [sum of |r|, tokens]
        bin_sums.append(sum_and_count[0])
        bin_count.append(sum_and_count[1])
        below, previous = previous, below
    bin_sums = torch.stack(bin_sums).double()
    bin_count = torch.stack(bin_count).double()
    rows = [(label,) for label in PROB_BIN_LABELS]
    out.put_vector("mismatch_abs_log_ratio_by_prob",
                   torch.where(bin_count > 0, bin_sums / bin_count.clamp_min(1), torch.nan), rows)
    out.put_vector("mismatch_tokens_by_prob", bin_count, rows)

    # |r| quantiles from the bit-pattern histogram (bin 0 holds the zeros off the valid set).
    a32 = a if work == torch.float32 else a.clamp(max=float(torch.finfo(torch.float32).max)).to(torch.float32)
    bins_out = em1.view(torch.int32) if work == torch.float32 else buf("bins", torch.int32)
    bins = torch.bitwise_right_shift(a32.view(torch.int32), _ABS_SHIFT, out=bins_out)   # 0 .. 65535
    every = bin_counts(bins, 1 << (31 - _ABS_SHIFT))
    last = _ABS_FIRST + _ABS_NBINS - 2                     # below 2^-40 -> bin 0, from 2^24 -> top bin
    hist = torch.cat([every[:_ABS_FIRST].sum().reshape(1), every[_ABS_FIRST:last], every[last:].sum().reshape(1)])
    hist[0] -= n_all - n.double()
    values, cum = _abs_bin_values(device, max_a), hist.cumsum(0)
    for q, name in ((0.5, "mismatch_abs_log_ratio_p50"), (0.99, "mismatch_abs_log_ratio_p99")):
        out.put(name, quantile_from_counts(hist, values, n.double(), q, cum).minimum(max_a.double()))


# --- version lag ---------------------------------------------------------------------------------

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
    size = _LAG_EXACT_MAX + 2                                                 # bin k holds lag k - 1
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
    hist = counts[1:]                                                         # lags 0 .. _LAG_EXACT_MAX
    lag_values = torch.arange(hist.numel(), device=hist.device, dtype=torch.float64)
    lag_sum = _dot(hist, lag_values)
    lag_max = seq_max.amax() if B else torch.zeros((), device=device)
    n_ok = n_mask - negative.double()
    out.put("negative_lag_tokens_total", negative)
    out.put("version_lag_mean", _safe_div(lag_sum, n_ok))
    out.put("version_lag_max", torch.where(n_ok > 0, lag_max.double(), torch.nan))
    out.put("version_lag_p99", quantile_from_counts(hist, lag_values, n_ok, 0.99))
    over = hist[int(math.floor(config.staleness_bound)) + 1:].sum()
    out.put("version_lag_over_bound_ratio", _safe_div(over, n_ok))
    out.put("tokens_over_staleness_bound_total", over)
    has_seq = (tokens_per_seq > 0).double()
    n_seq = has_seq.sum()
    out.put("version_lag_sequence_max_mean", _safe_div(_dot(seq_max.double().clamp_min(0), has_seq), n_seq))
    out.put("partial_rollout_ratio", _safe_div(spans.sum(), n_seq))
    out.put("partial_rollout_sequences_total", spans.sum())
    put_lag_histogram(out, hist, n_ok, lag_sum)


def token_lag_counts(version: torch.Tensor, trainer_version: int, mask: torch.Tensor,
                     ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram of per-token lag: counts [_LAG_EXACT_MAX + 2] where bin k holds lag k - 1 and bin 0
    holds off-mask and negative-lag tokens; also returns lag + 1 per token ([B, T], 0 off the mask)."""
    size = _LAG_EXACT_MAX + 2
    lag1 = torch.mul(mask, float(trainer_version) + 1.0, out=ws.get("lag", mask.shape, torch.float32, mask.device))
    lag1.addcmul_(version, mask, value=-1)
    bins = ws.get("lag_bins", mask.shape, torch.int32, mask.device)
    bins.copy_(torch.clamp(lag1, 0.0, float(size - 1), out=ws.get("lag_tmp", mask.shape, torch.float32,
                                                                   mask.device)))
    return bin_counts(bins, size), lag1


def put_lag_histogram(out: Pending, hist: torch.Tensor, n_ok: torch.Tensor, lag_sum: torch.Tensor) -> None:
    """Classic histogram buckets from exact lag counts (``hist[k]`` = tokens with lag k): per-bucket
    (non-cumulative) counts in LAG_BUCKETS order then +Inf, and the sum for ``_sum``."""
    at = torch.tensor(LAG_BUCKETS, device=hist.device)
    cum_at = hist.cumsum(0)[at]
    per_bucket = torch.cat([cum_at[:1], cum_at[1:] - cum_at[:-1], (n_ok - cum_at[-1:])])
    out.put_vector("token_version_lag", per_bucket, [(str(b),) for b in LAG_BUCKETS] + [("+Inf",)])
    out.put("token_version_lag_sum", lag_sum)


# --- groups, lengths, rewards, environments ----------------------------------------------------

def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact group ids [B] into 0..G-1 without a host sync. Returns (index [B], group_exists [B])
    where group_exists marks which of the B slots hold a group."""
    B = group_ids.numel()
    order = torch.argsort(group_ids, stable=True)
    g_sorted = group_ids[order]
    starts = torch.ones(B, dtype=torch.int64, device=group_ids.device)
    if B > 1:
        starts[1:] = (g_sorted[1:] != g_sorted[:-1]).to(torch.int64)
    idx_sorted = starts.cumsum(0) - 1
    index = torch.empty_like(idx_sorted)
    index[order] = idx_sorted
    exists = torch.zeros(B, dtype=torch.bool, device=group_ids.device)
    exists[idx_sorted] = True
    return index, exists


def group_signals(out: Pending, rewards: torch.Tensor, group_ids: torch.Tensor, ok: torch.Tensor,
                  config: SignalConfig) -> torch.Tensor:
    """Zero-variance GRPO groups. rewards [B] float, group_ids [B] int, ok [B] bool (episodes that did
    not fail for an infrastructure reason). Returns a per-episode float flag [B]: 1 when the
    episode's group has zero reward variance."""
    B = rewards.numel()
    rewards = rewards.to(torch.float64)
    okf = ok.to(torch.float64)
    index, _ = group_index(group_ids)
    size = torch.zeros(B, dtype=torch.float64, device=rewards.device).index_add_(0, index, okf)
    inf = torch.full_like(rewards, float("inf"))
    rmin = inf.clone().scatter_reduce_(0, index, torch.where(ok, rewards, inf), "amin")
    rmax = (-inf).scatter_reduce_(0, index, torch.where(ok, rewards, -inf), "amax")
    exists = size > 0
    zero_var = exists & (rmax == rmin)
    if config.reward_bounds is not None:
        lo = torch.tensor(float(config.reward_bounds[0]), dtype=torch.float64, device=rewards.device)
        hi = torch.tensor(float(config.reward_bounds[1]), dtype=torch.float64, device=rewards.device)
    else:
        ok_r = torch.where(ok, rewards, inf)
        lo = ok_r.amin() if B else torch.zeros((), dtype=torch.float64)
        hi = torch.where(ok, rewards, -inf).amax() if B else torch.zeros((), dtype=torch.float64)
    spread = hi > lo
    # When the whole batch is one constant, classify by sign: positive passes, otherwise fails.
    passes = zero_var & torch.where(spread, rmin >= hi, rmin > 0)
    fails = zero_var & ~passes & torch.where(spread, rmax <= lo, rmax <= 0)
    constant = zero_var & ~passes & ~fails
    n_groups = exists.double().sum()
    out.put("groups", n_groups)
    out.put("groups_total", n_groups)
    for kind, flags in zip(ZERO_VARIANCE_KINDS, (passes, fails, constant)):
        count = flags.double().sum()
        out.put("zero_variance_groups_ratio", _safe_div(count, n_groups), (kind,))
        out.put("zero_variance_groups_total", count, (kind,))
    episode_zero_var = zero_var.double()[index] * okf
    out.put("zero_gradient_episodes_ratio", _safe_div(episode_zero_var.sum(), okf.sum()))
    out.put("_group_size_min", torch.where(exists, size, inf).amin() if B else torch.tensor(float("nan")))
    out.put("_group_size_max", size.amax() if B else torch.tensor(float("nan")))
    return episode_zero_var


def length_signals(out: Pending, mask: torch.Tensor, truncated: torch.Tensor | None,
                   lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Response lengths (tokens, from the mask) and the truncated fraction. mask [B, T] float.
    Returns the lengths [B]."""
    lengths = (mask.sum(-1) if lengths is None else lengths).double()         # [B]
    B = lengths.numel()
    out.put("response_length_mean", lengths.mean() if B else torch.tensor(float("nan")))
    out.put("response_length_max", lengths.amax() if B else torch.tensor(float("nan")))
    out.put("response_length_p99", _sorted_quantile(lengths, 0.99))
    if truncated is not None:
        out.put("truncated_ratio", truncated.double().mean() if B else torch.tensor(float("nan")))
    return lengths


def reward_signals(out: Pending, rewards: torch.Tensor, ok: torch.Tensor) -> None:
    """Episode reward mean and std over episodes that did not fail. rewards [B], ok [B] bool."""
    okf = ok.double()
    r = torch.where(ok, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
    n = okf.sum()
    mean = _safe_div(r.sum(), n)
    var = _safe_div(_dot(r, r), n) - mean * mean
    out.put("reward_mean", mean)
    out.put("reward_std", var.clamp_min(0).sqrt())


def entropy_signal(out: Pending, entropy: torch.Tensor, mask: torch.Tensor) -> None:
    """Mean per-token entropy over masked tokens with a finite entropy. entropy, mask: [B, T]."""
    e = entropy.to(torch.float32)
    good = mask * (1.0 - _nonfinite_indicator(e))
    out.put("entropy_mean", _safe_div(_dot(e.nan_to_num(0.0, 0.0, 0.0), good), good.sum()))


def env_signals(out: Pending, env_index: torch.Tensor, env_names: Sequence[str], rewards: torch.Tensor | None,
                ok: torch.Tensor, truncated: torch.Tensor | None, episode_zero_var: torch.Tensor | None,
                group_ids: torch.Tensor | None, hacked: dict[str, torch.Tensor],
                lengths: torch.Tensor | None = None) -> None:
    """Per-environment episodes, reward, truncation, zero-variance groups and hack rates.

    env_index: [B] int index into env_names. rewards [B], ok/truncated [B] bool, hacked: detector
    name -> [B] bool. Failure rates by kind are counted on the host from the string labels.
    """
    E = len(env_names)
    rows = [(name,) for name in env_names]
    episodes = torch.bincount(env_index, minlength=E).double()[:E]
    out.put_vector("env_episodes", episodes, rows)
    out.put_vector("episodes_total", episodes, rows)
    okf = ok.double()
    if rewards is not None:
        r = torch.where(ok, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
        reward_sum = torch.bincount(env_index, weights=r, minlength=E)[:E]
        ok_count = torch.bincount(env_index, weights=okf, minlength=E)[:E]
        out.put_vector("env_reward_mean", torch.where(ok_count > 0, reward_sum / ok_count.clamp_min(1), torch.nan), rows)
        if lengths is not None:
            # Pearson correlation of reward with response length per environment (reward/length hack).
            n = lengths.double() * okf
            sums = [torch.bincount(env_index, weights=w, minlength=E)[:E] for w in (n, r * r, n * n, r * n)]
            s_n, s_rr, s_nn, s_rn = sums
            cov = ok_count * s_rn - reward_sum * s_n
            var = (ok_count * s_rr - reward_sum ** 2) * (ok_count * s_nn - s_n ** 2)
            corr = torch.where((ok_count >= 4) & (var > 0), cov / var.clamp_min(1e-300).sqrt(), torch.nan)
            out.put_vector("env_reward_length_corr", corr, rows)
    if truncated is not None:
        trunc = torch.bincount(env_index, weights=truncated.double(), minlength=E)[:E]
        out.put_vector("env_truncated_ratio", torch.where(episodes > 0, trunc / episodes.clamp_min(1), torch.nan), rows)
        out.put_vector("episodes_truncated_total", trunc, rows)
    if episode_zero_var is not None and group_ids is not None:
        index, exists = group_index(group_ids)
        B = env_index.numel()
        group_env = torch.zeros(B, dtype=env_index.dtype, device=env_index.device).scatter_(0, index, env_index)
        group_zero = torch.zeros(B, dtype=torch.float64, device=env_index.device).scatter_(0, index, episode_zero_var)
        n_groups = torch.bincount(group_env, weights=exists.double(), minlength=E)[:E]
        zero = torch.bincount(group_env, weights=group_zero * exists.double(), minlength=E)[:E]
        out.put_vector("env_zero_variance_groups_ratio",
                       torch.where(n_groups > 0, zero / n_groups.clamp_min(1), torch.nan), rows)
    for detector, flags in hacked.items():
        count = torch.bincount(env_index, weights=flags.double(), minlength=E)[:E]
        det_rows = [(name, detector) for name in env_names]
        out.put_vector("env_hack_ratio", torch.where(episodes > 0, count / episodes.clamp_min(1), torch.nan), det_rows)
        out.put_vector("episodes_hacked_total", count, det_rows)
        out.put_vector("episodes_judged_total", episodes, det_rows)


def failure_counts(env: Sequence[str], failed: Iterable[str | None]) -> dict[tuple[str, str], int]:
    """Host-side count of infrastructure failures per (env, kind) from per-episode labels."""
    counts: dict[tuple[str, str], int] = {}
    for e, kind in zip(env, failed):
        if kind:
            counts[(e, kind)] = counts.get((e, kind), 0) + 1
    return counts


# --- one step ------------------------------------------------------------------------------------

Values = dict[str, dict[tuple[str, ...], "float | None"]]


def compute_step(record: "StepRecord", config: SignalConfig, ws: Workspace | None = None) -> Values:
    """Every signal of one validated step, with exactly one host synchronisation.

    Returns ``{metric name: {label values: value}}`` using the names of :mod:`rlwatch.metrics`
    (gauges hold the step's value, counters the step's increment, the histogram its per-bucket
    counts). Names starting with ``_`` are internal checks, not exported.
    """
    out = Pending()
    mask = record.mask
    B = record.batch_size
    device = mask.device
    per_seq = mask.sum(-1)                                                     # [B] response lengths
    tokens = per_seq.sum()
    out.put("tokens", tokens)
    out.put("tokens_total", tokens)
    if record.trainer_logp is not None and record.sampler_logp is not None:
        mismatch_signals(out, record.trainer_logp, record.sampler_logp, mask, config, ws, tokens)
    if record.version is not None and record.trainer_version is not None:
        lag_signals(out, record.version, record.trainer_version, mask, config, ws, per_seq)
    if record.failed is not None:
        ok = torch.tensor([f is None for f in record.failed], dtype=torch.bool).to(device, non_blocking=True)
    else:
        ok = torch.ones(B, dtype=torch.bool, device=device)
    episode_zero_var = None
    if record.rewards is not None:
        reward_signals(out, record.rewards, ok)
        if record.group_ids is not None:
            episode_zero_var = group_signals(out, record.rewards, record.group_ids, ok, config)
    lengths = length_signals(out, mask, record.truncated, per_seq)
    if record.entropy is not None:
        entropy_signal(out, record.entropy, mask)
    if record.env_index is not None:
        env_signals(out, record.env_index, record.env_names, record.rewards, ok, record.truncated,
                    episode_zero_var, record.group_ids, record.hacked, lengths)
    values = out.resolve()

    values["step"] = {(): float(record.step)}
    values["steps_total"] = {(): 1.0}
    values["sequences"] = {(): float(B)}
    values["sequences_total"] = {(): float(B)}
    if record.trainer_version is not None:
        values["trainer_version"] = {(): float(record.trainer_version)}
    for key in ("temperature", "top_p", "top_k"):
        if key in record.sampling:
            values[f"sampler_{key}"] = {(): float(record.sampling[key])}
    if "logprobs_mode" in record.sampling:
        values["sampler_info"] = {(str(record.sampling["logprobs_mode"]),): 1.0}
    if record.failed is not None and record.env is not None:
        failures = failure_counts(record.env, record.failed)
        episodes = values.get("env_episodes", {})
        values["episodes_failed_total"] = {k: float(v) for k, v in failures.items()}
        values["env_failure_ratio"] = {
            (e, kind): (count / episodes[(e,)] if episodes.get((e,)) else None)
            for (e, kind), count in failures.items()}
        # Kinds seen earlier but absent now are reported as 0 by the exporter state.
    return values


def compute(config: SignalConfig | None = None, **fields) -> Values:
    """Compute every signal of one step from plain tensors, without exporting anything.

    Takes the same fields as :meth:`rlwatch.Watch.observe` (``mask`` required, ``step`` optional)
    and raises :class:`~rlwatch.errors.InvalidFieldError` on a malformed field.
    """
    from .errors import HookErrors
    from .record import RecordBuilder

    config = config or SignalConfig()
    step = fields.pop("step", 0)
    builder = RecordBuilder(HookErrors(strict=True), group_size=config.group_size)
    ws = Workspace()
    record = builder.build(step, fields, ws)
    assert record is not None
    return compute_step(record, config, ws)
