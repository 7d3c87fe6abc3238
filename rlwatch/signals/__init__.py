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
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, Sequence

import torch

from . import fused
from ..metrics import LAG_BUCKETS, PROB_BIN_EDGES, PROB_BIN_LABELS, ZERO_VARIANCE_KINDS

if TYPE_CHECKING:
    from ..record import StepRecord

SAFETY_BOUND = 20.0  # |r| clamp before exp, as verl's rollout_corr_helper.SAFETY_BOUND

# On steps of more than EXACT_QUANTILE_MAX_TOKENS positions, |r| quantiles come from a histogram over
# the float32 bit pattern of |r| (a sort costs n log n): for non-negative floats the
# bits are monotone in the value, and bits >> 15 gives 256 equal-width bins per power of two. A bin's
# midpoint is within 0.2% of any value in it. The bins span [2^-40, 2^24) nats; smaller values count
# as 0 and larger ones share the top bin, represented by the exact maximum.
_ABS_SHIFT = 15
_ABS_FIRST = (127 - 40) << 8                 # bit-pattern bin of 2^-40
_ABS_NBINS = ((127 + 24) << 8) - _ABS_FIRST + 2   # + the zero bin and the top bin

# Up to this many [B, T] positions per step, |r| quantiles are exact (one sort): on CPU a sort is
# cheaper than the histogram's fixed 16k bins below about 10k positions (measured side by side).
EXACT_QUANTILE_MAX_TOKENS = 8192

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
    """Device tensors waiting for the step's single host transfer, and the host formulas that finish
    them.

    ``put(name, value, labels)`` stores a scalar and ``put_vector(name, tensor, label_rows)`` one value
    per label row. ``derive(name, fn, *parts)`` and ``derive_vector(name, fn, rows, *parts)`` store
    reductions whose final formula (a ratio, a variance, a correlation) runs on the host in float64
    after the transfer: each 0-d part reaches ``fn`` as a float, each 1-d part as a list, and anything
    else unchanged. On small batches a formula on 0-d device tensors costs more than the reductions
    themselves. ``resolve()`` returns ``{name: {labels: float | None}}``; NaN, infinities and a
    formula's division by zero resolve to None.
    """

    def __init__(self) -> None:
        self._scalars: list[torch.Tensor] = []       # 0-d parts, stacked for the transfer
        self._vectors: list[torch.Tensor] = []       # 1-d parts, concatenated after the scalars
        self._entries: list[tuple[str, Any, Callable[..., Any] | None, tuple[Any, ...]]] = []

    def _part(self, value: Any) -> Any:
        if isinstance(value, _Slot):                 # already registered with :meth:`vector`
            return value
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                self._scalars.append(value)
                return _Slot(len(self._scalars) - 1, None)
            self._vectors.append(value if value.dim() == 1 else value.reshape(-1))
            return _Slot(len(self._vectors) - 1, value.numel())
        return value

    def vector(self, values: torch.Tensor) -> Any:
        """Register a 1-d tensor once; the returned handle can be a part of any number of entries."""
        return self._part(values.reshape(-1) if values.dim() != 1 else values)

    def host(self, fn: Callable[..., "Values"], *parts: Any) -> None:
        """``fn(*parts)`` on the host returns several ``{name: {labels: value}}`` families at once."""
        self._entries.append(("", None, fn, tuple(self._part(p) for p in parts)))

    def put(self, name: str, value: torch.Tensor | float, labels: tuple[str, ...] = ()) -> None:
        if isinstance(value, torch.Tensor) and value.dim():
            value = value.reshape(())
        self._entries.append((name, labels, None, (self._part(value),)))

    def derive(self, name: str, fn: Callable[..., float | None], *parts: Any, labels: tuple[str, ...] = ()) -> None:
        self._entries.append((name, labels, fn, tuple(self._part(p) for p in parts)))

    def ratio(self, name: str, num: Any, den: Any, labels: tuple[str, ...] = ()) -> None:
        """num / den on the host; None when den is 0."""
        self.derive(name, _div, num, den, labels=labels)

    def put_vector(self, name: str, values: torch.Tensor, label_rows: Sequence[tuple[str, ...]]) -> None:
        self.derive_vector(name, None, label_rows, values)

    def derive_vector(self, name: str, fn: Callable[..., Sequence[float | None]] | None,
                      label_rows: Sequence[tuple[str, ...]], *parts: Any) -> None:
        rows = list(label_rows)
        slots = tuple(self._part(p) for p in parts)
        if fn is None and slots[0].size != len(rows):
            raise ValueError(f"{name}: {slots[0].size} values for {len(rows)} label rows")
        self._entries.append((name, rows, fn, slots))

    def resolve(self) -> dict[str, dict[tuple[str, ...], float | None]]:
        # Scalars are stacked per dtype: stacking mixed dtypes is several times slower.
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(self._scalars):
            groups.setdefault((t.dtype, t.device), []).append(i)
        tensors = [torch.stack([self._scalars[i] for i in members]) for members in groups.values()]
        tensors += self._vectors
        if not tensors:
            return {}
        if len({t.device for t in tensors}) > 1:
            tensors = [t.cpu() for t in tensors]
        host = torch.cat(tensors).to(torch.float64).tolist()   # the one host synchronisation of the step
        position = [0] * len(self._scalars)
        for at, i in enumerate(i for members in groups.values() for i in members):
            position[i] = at
        offsets, at = [], len(self._scalars)
        for v in self._vectors:
            offsets.append(at)
            at += v.numel()

        def value(part: Any) -> Any:
            if not isinstance(part, _Slot):
                return part
            if part.size is None:
                return host[position[part.index]]
            start = offsets[part.index]
            return host[start:start + part.size]

        out: dict[str, dict[tuple[str, ...], float | None]] = {}
        for name, labels, fn, parts in self._entries:
            args = [value(p) for p in parts]
            if labels is None:                      # a host() entry: several families at once
                for family_name, rows in fn(*args).items():
                    target = out.setdefault(family_name, {})
                    for row, v in rows.items():
                        target[row] = _finite(v)
                continue
            family = out.setdefault(name, {})
            if isinstance(labels, tuple):
                family[labels] = _finite(_apply(fn, args) if fn else args[0])
            else:
                results = _apply(fn, args) if fn else args[0]
                if results is None:
                    results = [None] * len(labels)
                for row, v in zip(labels, results):
                    family[row] = _finite(v)
        return out


class _Slot(NamedTuple):
    index: int
    size: int | None          # None for a scalar


def _apply(fn: Callable[..., Any], args: list[Any]) -> Any:
    try:
        return fn(*args)
    except (ZeroDivisionError, ValueError, OverflowError):
        return None


def _finite(v: Any) -> float | None:
    return v if v is not None and math.isfinite(v) else None


# --- small vectorised helpers -----------------------------------------------------------------

def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.numel() < 65536:
        # BLAS dot wakes its thread pool even for a few thousand elements, which stalls for a whole
        # scheduler time slice on a busy host; small products stay in one thread this way.
        return (a * b).sum()
    return torch.dot(a.reshape(-1), b.reshape(-1))


def _nonfinite_indicator(x: torch.Tensor) -> torch.Tensor:
    """1.0 where ``x`` is NaN or infinite, else 0.0 (x - x is NaN exactly there)."""
    return (x - x).nan_to_num_(nan=1.0)


_CONSTANTS: dict[tuple[torch.device, torch.dtype, tuple[float, ...]], torch.Tensor] = {}


def _constant(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A [len(values)] tensor on ``device``, copied there once per process (a host-to-device copy
    each step would wait for the device's queue)."""
    key = (device, dtype, tuple(values))
    tensor = _CONSTANTS.get(key)
    if tensor is None:          # read-only, so one made in inference mode serves outside it too
        tensor = _CONSTANTS[key] = torch.tensor(key[2], dtype=dtype, device=device)
    return tensor


def quantile_from_counts(counts: torch.Tensor, values: torch.Tensor, n: torch.Tensor,
                         qs: Sequence[float]) -> torch.Tensor:
    """The ``qs``-quantiles [Q] (linear interpolation between order statistics, as ``torch.quantile``)
    of ``n`` items binned by ``counts`` [K] float64, each bin represented by ``values`` [K]; NaN when
    n is 0. No host sync."""
    ranks, frac = _order_ranks(n, qs, counts.device)
    bins = torch.searchsorted(counts.cumsum(0), ranks, right=True).clamp_max_(counts.numel() - 1)
    return _interpolate(values[bins], frac, n)


def masked_quantiles(values: torch.Tensor, keep: torch.Tensor, n: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """The exact ``qs``-quantiles [Q] float64 (as ``torch.quantile``) of the finite ``values`` where
    ``keep`` is 1 (``n`` of them; same shapes); NaN when n is 0. One sort, no host sync."""
    if values.numel() == 0:                                    # an empty batch: nothing to index
        return torch.full((len(qs),), torch.nan, dtype=torch.float64, device=values.device)
    kept_first = torch.where(keep.reshape(-1) > 0, values.reshape(-1), torch.inf).sort().values
    ranks, frac = _order_ranks(n, qs, values.device)
    return _interpolate(kept_first[ranks.long()].to(torch.float64), frac, n)


def _order_ranks(n: torch.Tensor, qs: Sequence[float], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The order statistics [2, Q] (0-based, as float64) that each ``qs``-quantile of ``n`` items lies
    between, and its position between them [Q] (linear interpolation, as ``torch.quantile``)."""
    top = (n.to(torch.float64) - 1).clamp_min(0)
    rank = _constant(qs, device) * top
    lo_rank = rank.floor()
    return torch.stack([lo_rank, (lo_rank + 1).minimum(top)]), rank - lo_rank


def _interpolate(pairs: torch.Tensor, frac: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Values [Q] between the order statistics ``pairs`` [2, Q]; NaN when there are no items (n = 0)."""
    return torch.where(n > 0, pairs[0] + frac * (pairs[1] - pairs[0]), torch.nan)


def _div(num: float, den: float) -> float | None:
    """num / den on the host; None when den is 0. Every denominator here counts the items its
    numerator sums over, so an empty set has no value."""
    return num / den if den else None


def _ess_ratio(sum_em1: float, sq_em1: float, n: float) -> float | None:
    """Effective sample size / n of weights w from sum(w - 1), sum((w - 1)^2) and n; (sum w)^2 <=
    n sum w^2 (Cauchy-Schwarz), so the cap at 1 only removes float rounding."""
    sum_w, sum_w2 = n + sum_em1, n + sq_em1 + 2 * sum_em1
    ratio = _div(sum_w * sum_w, n * sum_w2)
    return None if ratio is None else min(ratio, 1.0)


def _slope(rs_and_ss: list[float], s_sum: float, r_sum: float, n: float) -> float | None:
    """Least-squares slope of r on s from sum(r s), sum(s^2), sum(s), sum(r) and n; None when s is
    (numerically) constant."""
    rs, s_sq = rs_and_ss
    var_s = n * s_sq - s_sum * s_sum
    return (n * rs - s_sum * r_sum) / var_s if var_s > 1e-9 * n * n else None


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
    nothing. One workspace belongs to one caller at a time (``Watch`` holds a lock). ``compile``
    chooses whether the token signals run compiled (see :mod:`rlwatch.signals.engine`).
    """

    def __init__(self, compile: str | None = None) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.compile = compile       # "auto", "always" or "never"; None: RLWATCH_COMPILE (see engine)
        self.compiled_steps = 0      # steps whose token signals ran as compiled code

    def get(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if (buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != device
                or buf.is_inference() and not torch.is_inference_mode_enabled()):
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf


# --- mismatch and importance sampling ----------------------------------------------------------

def bin_counts(index: torch.Tensor, size: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Counts (or weight sums) of ``index`` values in [0, size), float64 [size], without a host sync.

    ``torch.bincount`` sizes its output from the data, which synchronises on accelerators; there a
    scatter-add of integers into a fixed-size tensor is used instead. Indices must already lie in
    [0, size); weights must be whole numbers there.
    """
    index = index.reshape(-1)
    if index.device.type == "cpu":
        w = None if weights is None else weights.reshape(-1).to(torch.float64)
        return torch.bincount(index, weights=w, minlength=size).to(torch.float64)[:size]
    # Integer atomics: float64 atomics are slow on GPUs (the weights here are token counts).
    src = torch.ones_like(index, dtype=torch.int64) if weights is None else weights.reshape(-1).to(torch.int64)
    return torch.zeros(size, dtype=torch.int64, device=index.device).scatter_add_(0, index.long(), src).to(torch.float64)


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

    # First and second moments of r and |r|; every ratio below is finished on the host.
    sum_r = r.sum()
    out.ratio("mismatch_log_ratio_mean", sum_r, n)
    out.derive("mismatch_kl_k1", lambda s, n: _div(-s, n), sum_r, n)
    out.derive("mismatch_kl_k2", lambda rr, n: _div(0.5 * rr, n), _dot(r, r), n)
    a = torch.abs(r, out=a_buf)
    max_a = a.amax() if n_all else torch.zeros((), dtype=work, device=device)
    out.ratio("mismatch_abs_log_ratio_mean", a.sum(), n)
    out.derive("mismatch_abs_log_ratio_max", lambda m, n: m if n > 0 else None, max_a, n)

    # w - 1 = expm1(r) with |r| clamped; 0 off the valid set, so every sum below is over valid tokens.
    em1 = torch.clamp(r, -SAFETY_BOUND, SAFETY_BOUND, out=buf("em1")).expm1_()
    tmp = buf("tmp")
    out.ratio("mismatch_kl_k3", torch.sub(em1, r, out=tmp).sum(), n)
    sum_em1, sq_em1 = em1.sum(), _dot(em1, em1)
    out.derive("mismatch_chi2_token", lambda s, sq, n: _div(sq + 2 * s, n), sum_em1, sq_em1, n)  # mean(w^2 - 1)
    out.derive("is_ess_raw_ratio", _ess_ratio, sum_em1, sq_em1, n)
    cap = config.is_cap
    em1_t = torch.clamp(em1, max=cap - 1.0, out=tmp)                          # min(w, C) - 1
    out.derive("is_ess_ratio", _ess_ratio, em1_t.sum(), _dot(em1_t, em1_t), n)
    importance_ratio_signals(out, r, valid, sum_em1, n)

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
    mis_below, mis_above = count("<", mis_low - 1.0), count(">", mis_high - 1.0)
    out.ratio("is_tis_high_ratio", high, n)
    out.ratio("is_tis_low_ratio", low, n)
    out.derive("is_mis_masked_ratio", lambda lo, hi, n: _div(lo + hi, n), mis_below, mis_above, n)
    out.put("is_tis_truncated_tokens_total", high)
    out.derive("is_mis_masked_tokens_total", operator.add, mis_below, mis_above)

    # Slope of r against log mu over valid tokens (a temperature mismatch makes r linear in log mu).
    s_valid = torch.mul(sampler_logp, valid, out=r_and_s[1]).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    out.derive("mismatch_log_ratio_slope", _slope, torch.mv(r_and_s.view(2, -1), s_valid.reshape(-1)),
               s_valid.sum(), sum_r, n)
    neg_s = torch.mul(s_valid, -_SCALE, out=em1)          # -log mu scaled, for the probability bands below

    # Sequence level: s_b = sum_t r, weight exp(s_b), over sequences with at least one valid token.
    # The per-sequence terms are stacked and summed over those sequences in one matrix-vector product.
    seq_r = r.sum(-1).double()                                                # [B]
    has = (valid.sum(-1) > 0).to(torch.float64)                               # [B]
    seq_abs = seq_r.abs()
    log_cap = math.log(cap)
    terms = torch.stack([has, seq_abs, torch.expm1(2 * seq_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)),
                         seq_r > log_cap, seq_r < -log_cap,
                         (seq_r < math.log(mis_low)) | (seq_r > math.log(mis_high))])   # [6, B]
    seq_sums = torch.mv(terms.to(torch.float64), has)     # n_seq, then the sums of the five terms
    for i, name in enumerate(("mismatch_seq_log_ratio_abs_mean", "mismatch_chi2_sequence", "is_seq_tis_high_ratio",
                              "is_seq_tis_low_ratio", "is_seq_mis_masked_ratio"), start=1):
        out.derive(name, lambda sums, i=i: _div(sums[i], sums[0]), seq_sums)
    seq_max = (seq_abs * has).amax() if seq_abs.numel() else seq_abs.sum()
    out.derive("mismatch_seq_log_ratio_abs_max", lambda m, sums: m if sums[0] > 0 else None, seq_max, seq_sums)

    # Mean |r| by sampler probability: dot products with the 0/1 indicator of each probability band
    # (computed per band rather than as differences of cumulative sums, which lose float32 precision).
    below, previous, band = tmp, r, r_and_s[1]             # r and s_valid are no longer needed
    band_sums = []
    for i, edge in enumerate((*PROB_BIN_EDGES, None)):
        if edge is not None:
            torch.add(neg_s, math.log(edge) * _SCALE, out=below).clamp_(0.0, 1.0)   # [log mu < log edge]
            indicator = below if i == 0 else torch.sub(below, previous, out=band)
        else:
            indicator = previous.neg_().add_(1.0)                              # [log mu >= last edge]
        band_sums.append(torch.mv(pair.view(2, -1), indicator.reshape(-1)))  # [sum of |r|, tokens]
        below, previous = previous, below
    by_band = torch.stack(band_sums)                                          # [bands, 2]
    rows = [(label,) for label in PROB_BIN_LABELS]
    out.derive_vector("mismatch_abs_log_ratio_by_prob",
                      lambda flat: [_div(flat[k], flat[k + 1]) for k in range(0, len(flat), 2)], rows, by_band)
    out.derive_vector("mismatch_tokens_by_prob", lambda flat: flat[1::2], rows, by_band)

    # |r| quantiles: exact (one sort) on small steps, where the histogram's 16k bins would cost more
    # than the step's other signals; else from the bit-pattern histogram (bin 0 holds the zeros off
    # the valid set), whose cost grows linearly with the tokens.
    if n_all <= EXACT_QUANTILE_MAX_TOKENS:
        quantiles = masked_quantiles(a, valid, n, (0.5, 0.99))
    else:
        a32 = a if work == torch.float32 else a.clamp(max=float(torch.finfo(torch.float32).max)).to(torch.float32)
        bins_out = em1.view(torch.int32) if work == torch.float32 else buf("bins", torch.int32)
        bins = torch.bitwise_right_shift(a32.view(torch.int32), _ABS_SHIFT, out=bins_out)   # 0 .. 65535
        every = bin_counts(bins, 1 << (31 - _ABS_SHIFT))
        last = _ABS_FIRST + _ABS_NBINS - 2                 # below 2^-40 -> bin 0, from 2^24 -> top bin
        hist = torch.cat([every[:_ABS_FIRST].sum().reshape(1), every[_ABS_FIRST:last],
                          every[last:].sum().reshape(1)])
        hist[0] -= n_all - n.double()
        quantiles = quantile_from_counts(hist, _abs_bin_values(device, max_a), n, (0.5, 0.99))
    for i, name in enumerate(("mismatch_abs_log_ratio_p50", "mismatch_abs_log_ratio_p99")):
        out.derive(name, lambda qs, m, i=i: min(qs[i], m), quantiles, max_a)     # a bin's midpoint <= max


# --- version lag ---------------------------------------------------------------------------------

def _ratio_of(r: float, n: float) -> float | None:
    """exp(r) with r clamped to [-SAFETY_BOUND, SAFETY_BOUND], or None without valid tokens."""
    return math.exp(min(max(r, -SAFETY_BOUND), SAFETY_BOUND)) if n > 0 else None


def importance_ratio_signals(out: Pending, r: torch.Tensor, valid: torch.Tensor, sum_em1: torch.Tensor,
                             n: torch.Tensor) -> None:
    """Minimum, mean and maximum of the token importance ratio w = exp(r) over the valid tokens (r clamped
    to [-SAFETY_BOUND, SAFETY_BOUND] as everywhere): what TRL logs as sampling/importance_sampling_ratio/*
    before its correction truncates or masks. r, valid: [B, T], r 0 and valid 0 off the valid set;
    sum_em1: sum of exp(r) - 1 over them; n: their count. Two reductions; exp on the host."""
    if r.numel():
        keep = valid > 0
        low, high = torch.where(keep, r, torch.inf).amin(), torch.where(keep, r, -torch.inf).amax()
    else:
        low = high = torch.zeros((), dtype=r.dtype, device=r.device)
    out.derive("is_ratio_min", _ratio_of, low, n)
    out.derive("is_ratio_max", _ratio_of, high, n)
    out.derive("is_ratio_mean", lambda s, count: _div(count + s, count), sum_em1, n)


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
    cum_at = hist.cumsum(0)[_constant(LAG_BUCKETS, hist.device, torch.int64)]
    out.derive_vector("token_version_lag", _bucket_counts, [(str(b),) for b in LAG_BUCKETS] + [("+Inf",)],
                      cum_at, n_ok)
    out.put("token_version_lag_sum", lag_sum)


def _bucket_counts(cumulative: list[float], total: float) -> list[float]:
    """Per-bucket counts from cumulative counts at the bucket bounds, then the rest up to ``total``."""
    return [b - a for a, b in zip([0.0, *cumulative], [*cumulative, total])]


# --- groups, lengths, rewards, environments ----------------------------------------------------

def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact group ids [B] into 0..G-1 without a host sync. Returns (index [B], group_exists [B])
    where group_exists marks which of the B slots hold a group."""
    B = group_ids.numel()
    order = torch.argsort(group_ids, stable=True)
    g_sorted = group_ids[order]
    starts = torch.ones(B, dtype=torch.int64, device=group_ids.device)
    if B > 1:
        torch.ne(g_sorted[1:], g_sorted[:-1], out=starts[1:])
    idx_sorted = starts.cumsum_(0).sub_(1)
    index = torch.empty_like(idx_sorted).scatter_(0, order, idx_sorted)
    exists = torch.arange(B, device=group_ids.device) <= idx_sorted[-1:] if B else starts.bool()
    return index, exists


def group_signals(out: Pending, rewards: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor],
                  ok: torch.Tensor, config: SignalConfig) -> torch.Tensor:
    """Zero-variance GRPO groups. rewards [B] float, groups: :func:`group_index` of the group ids,
    ok [B] bool (episodes that did not fail for an infrastructure reason). Returns the zero-variance
    flag per group slot [B] bool (over the group's episodes that did not fail)."""
    B = rewards.numel()
    index = groups[0]
    rewards = rewards.to(torch.float64)
    okf = ok.to(torch.float64)
    size = torch.zeros(B, dtype=torch.float64, device=rewards.device).index_add_(0, index, okf)
    # (r, -r) of the episodes that did not fail, +inf elsewhere: one scatter-min gives each group's
    # minimum and -maximum, one min over the batch the bounds.
    signed = torch.where(ok.unsqueeze(1), torch.stack([rewards, -rewards], 1), torch.inf)     # [B, 2]
    extremes = torch.full_like(signed, torch.inf).scatter_reduce_(0, index.unsqueeze(1).expand(B, 2), signed, "amin")
    rmin, rmax = extremes[:, 0], -extremes[:, 1]
    exists = size > 0
    zero_var = exists & (rmax == rmin)
    # When the whole batch is one constant, classify by sign: positive passes, otherwise fails.
    # Configured bounds are chosen on the host; inferred ones on the device, without a sync.
    if config.reward_bounds is not None or not B:
        lo, hi = (float(v) for v in config.reward_bounds or (0.0, 0.0))
        at_pass, at_fail = ((rmin >= hi), (rmax <= lo)) if hi > lo else ((rmin > 0), (rmax <= 0))
    else:
        bounds = signed.amin(0)
        lo, hi = bounds[0], -bounds[1]
        spread = hi > lo
        at_pass, at_fail = torch.where(spread, rmin >= hi, rmin > 0), torch.where(spread, rmax <= lo, rmax <= 0)
    passes = zero_var & at_pass
    fails = zero_var & ~passes & at_fail
    constant = zero_var & ~passes & ~fails
    episode_zero_var = zero_var[index] * okf
    # groups, the three kinds of constant groups, zero-variance episodes, episodes: one product.
    sums = torch.mv(torch.stack([exists, passes, fails, constant, episode_zero_var, okf]).to(torch.float64),
                    torch.ones(B, dtype=torch.float64, device=rewards.device))
    out.derive("groups", operator.itemgetter(0), sums)
    out.derive("groups_total", operator.itemgetter(0), sums)
    for i, kind in enumerate(ZERO_VARIANCE_KINDS, start=1):
        out.derive("zero_variance_groups_ratio", lambda sums, i=i: _div(sums[i], sums[0]), sums, labels=(kind,))
        out.derive("zero_variance_groups_total", operator.itemgetter(i), sums, labels=(kind,))
    out.derive("zero_gradient_episodes_ratio", lambda sums: _div(sums[4], sums[5]), sums)
    out.put("_group_size_min", torch.where(exists, size, torch.inf).amin() if B else torch.tensor(float("nan")))
    out.put("_group_size_max", size.amax() if B else torch.tensor(float("nan")))
    return zero_var


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
    r = torch.where(ok, rewards.double(), 0.0)               # a failed episode's reward may be NaN
    moments = torch.mv(torch.stack([okf, r, r * r]), okf)                    # n, sum r, sum r^2
    out.derive("reward_mean", lambda m: _div(m[1], m[0]), moments)
    out.derive("reward_std", _std, moments)


def _std(moments: list[float]) -> float | None:
    """Population standard deviation from [n, sum x, sum x^2]."""
    n, s, sq = moments
    return math.sqrt(max(sq / n - (s / n) ** 2, 0.0)) if n else None


def entropy_signal(out: Pending, entropy: torch.Tensor, mask: torch.Tensor) -> None:
    """Mean per-token entropy over masked tokens with a finite entropy. entropy, mask: [B, T]."""
    e = entropy.to(torch.float32)
    good = mask * (1.0 - _nonfinite_indicator(e))
    out.ratio("entropy_mean", _dot(e.nan_to_num(0.0, 0.0, 0.0), good), good.sum())


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
        out.setdefault("env_hack_ratio", {}).update({row: _div(c, e) for row, c, e in zip(det_rows, count, episodes)})
        out.setdefault("episodes_hacked_total", {}).update(dict(zip(det_rows, count)))
        out.setdefault("episodes_judged_total", {}).update(dict(zip(det_rows, episodes)))
    return out


def failure_counts(env: Sequence[str], failed: Iterable[str | None]) -> dict[tuple[str, str], int]:
    """Host-side count of infrastructure failures per (env, kind) from per-episode labels."""
    counts: dict[tuple[str, str], int] = {}
    for e, kind in zip(env, failed):
        if kind:
            counts[(e, kind)] = counts.get((e, kind), 0) + 1
    return counts


# --- the fused token engine ---------------------------------------------------------------------

# Eagerly, steps of up to this many [B, T] positions run the fused function (fewer operations and
# less Python per step); larger ones the in-place path above, whose scratch buffers are reused across
# steps (less memory, no page faults). Around 2,048 positions the in-place path becomes the cheaper
# one (CPU time, measured side by side). Once compiled (see :mod:`rlwatch.signals.engine`), the
# fused function runs at every size.
FUSED_EAGER_MAX_TOKENS = 1024

_BAND_THRESHOLDS = tuple(math.log(edge) for edge in PROB_BIN_EDGES)


def _fused_constants(config: SignalConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    cap, (low, high) = config.is_cap, config.mis_band
    thresholds = _constant((cap - 1.0, 1.0 / cap - 1.0, low - 1.0, high - 1.0, *_BAND_THRESHOLDS,
                            math.log(cap), -math.log(cap), math.log(low), math.log(high)), device)
    mids = _ABS_VALUES.get(device)
    if mids is None:
        _abs_bin_values(device, torch.zeros((), device=device))
        mids = _ABS_VALUES[device]
    return (thresholds, mids, _constant(LAG_BUCKETS, device, torch.int64), _constant((0.5, 0.99), device),
            _constant((float(math.floor(config.staleness_bound)) + 1.0,), device).reshape(()))


def token_signals(out: Pending, record: "StepRecord", config: SignalConfig, ws: Workspace | None) -> bool:
    """The token-level signals (tokens, mismatch, importance sampling, version lag) from the fused
    engine, compiled when ready, else eagerly on small steps. False when the caller should use the
    in-place path (a large step with no compiled engine yet)."""
    from . import engine

    mask = record.mask
    mismatch = record.trainer_logp is not None and record.sampler_logp is not None
    lag = record.version is not None and record.trainer_version is not None
    device = mask.device
    n_all = mask.numel()
    compile = ws.compile if ws is not None else "never"
    if n_all > FUSED_EAGER_MAX_TOKENS and not engine.wants_compile(device, compile):
        return False
    exact = n_all <= EXACT_QUANTILE_MAX_TOKENS
    trainer_version = (torch.tensor(float(record.trainer_version), dtype=torch.float64).to(device, non_blocking=True)
                       if lag else None)
    version = record.version if lag else None
    if version is not None and version.shape != mask.shape:
        version = version.contiguous()          # [B] or [B, 2], often a strided slice: cheap to copy
    args = (mask, record.trainer_logp if mismatch else None, record.sampler_logp if mismatch else None,
            version, trainer_version, *_fused_constants(config, device))
    vector, _ = engine.run(args, exact, compile, eager=n_all <= FUSED_EAGER_MAX_TOKENS)
    if vector is None:
        return False
    pos = fused.layout(mismatch, lag, len(PROB_BIN_LABELS), len(LAG_BUCKETS))

    def finish(v: list[float]) -> "Values":
        if ws is not None and v[pos["compiled"]] == 1.0:
            ws.compiled_steps += 1
        return _finish_tokens(v, pos, mismatch, lag)
    out.host(finish, out.vector(vector))
    return True


def _finish_tokens(v: list[float], pos: dict[str, Any], mismatch: bool, lag: bool) -> "Values":
    """The host formulas of the token signals from :func:`fused.token_core`'s vector."""
    def at(name: str) -> float:
        return v[pos[name]]

    tokens = at("tokens")
    out: Values = {"tokens": {(): tokens}, "tokens_total": {(): tokens}}

    def put(name: str, value: float | None, labels: tuple[str, ...] = ()) -> None:
        out.setdefault(name, {})[labels] = value

    if mismatch:
        n, nonfinite = at("n"), at("nonfinite")
        for name, value in (("nonfinite_tokens", nonfinite), ("nonfinite_tokens_total", nonfinite),
                            ("mismatch_tokens", n), ("mismatch_tokens_total", n)):
            put(name, value)
        sum_r, max_a = at("sum_r"), at("max_a")
        put("mismatch_log_ratio_mean", _div(sum_r, n))
        put("mismatch_kl_k1", _div(-sum_r, n))
        put("mismatch_kl_k2", _div(0.5 * at("sum_r2"), n))
        put("mismatch_abs_log_ratio_mean", _div(at("sum_a"), n))
        put("mismatch_abs_log_ratio_max", max_a if n > 0 else None)
        put("mismatch_kl_k3", _div(at("sum_k3"), n))
        sum_em1, sq_em1 = at("sum_em1"), at("sq_em1")
        put("mismatch_chi2_token", _div(sq_em1 + 2 * sum_em1, n))
        put("is_ess_raw_ratio", _ess_ratio(sum_em1, sq_em1, n))
        put("is_ess_ratio", _ess_ratio(at("sum_em1t"), at("sq_em1t"), n))
        put("is_ratio_min", _ratio_of(at("min_r"), n))
        put("is_ratio_max", _ratio_of(at("max_r"), n))
        put("is_ratio_mean", _div(n + sum_em1, n))
        high, masked = at("high"), at("mis_below") + at("mis_above")
        put("is_tis_high_ratio", _div(high, n))
        put("is_tis_low_ratio", _div(at("low"), n))
        put("is_mis_masked_ratio", _div(masked, n))
        put("is_tis_truncated_tokens_total", high)
        put("is_mis_masked_tokens_total", masked)
        put("mismatch_log_ratio_slope", _apply(_slope, [[at("rs"), at("ss")], at("s_sum"), sum_r, n]))
        seq_n = at("seq_n")
        for name, field in (("mismatch_seq_log_ratio_abs_mean", "seq_abs"), ("mismatch_chi2_sequence", "seq_chi2"),
                            ("is_seq_tis_high_ratio", "seq_high"), ("is_seq_tis_low_ratio", "seq_low"),
                            ("is_seq_mis_masked_ratio", "seq_mis")):
            put(name, _div(at(field), seq_n))
        put("mismatch_seq_log_ratio_abs_max", at("seq_max") if seq_n > 0 else None)
        bands = v[pos["bands"]]
        for k, label in enumerate(PROB_BIN_LABELS):
            put("mismatch_abs_log_ratio_by_prob", _div(bands[2 * k], bands[2 * k + 1]), (label,))
            put("mismatch_tokens_by_prob", bands[2 * k + 1], (label,))
        for name, field in (("mismatch_abs_log_ratio_p50", "q50"), ("mismatch_abs_log_ratio_p99", "q99")):
            put(name, min(at(field), max_a) if math.isfinite(at(field)) else None)
    if lag:
        n_ok, lag_sum, over, seq_n, spans = at("n_ok"), at("lag_sum"), at("over"), at("lag_seq_n"), at("spans")
        put("negative_lag_tokens_total", at("negative"))
        put("version_lag_mean", _div(lag_sum, n_ok))
        put("version_lag_max", at("lag_max") if n_ok > 0 else None)
        put("version_lag_p99", at("lag_p99"))
        put("version_lag_over_bound_ratio", _div(over, n_ok))
        put("tokens_over_staleness_bound_total", over)
        put("version_lag_sequence_max_mean", _div(at("lag_seq_max_sum"), seq_n))
        put("partial_rollout_ratio", _div(spans, seq_n))
        put("partial_rollout_sequences_total", spans)
        rows = [(str(b),) for b in LAG_BUCKETS] + [("+Inf",)]
        out["token_version_lag"] = dict(zip(rows, _bucket_counts(v[pos["lag_cum"]], n_ok)))
        put("token_version_lag_sum", lag_sum)
    return out


# --- one step ------------------------------------------------------------------------------------

Values = dict[str, dict[tuple[str, ...], "float | None"]]


def compute_step(record: "StepRecord", config: SignalConfig, ws: Workspace | None = None) -> Values:
    """Every signal of one validated step, with exactly one host synchronisation.

    Returns ``{metric name: {label values: value}}`` using the names of :mod:`rlwatch.metrics`
    (gauges hold the step's value, counters the step's increment, the histogram its per-bucket
    counts). Names starting with ``_`` are internal checks, not exported. Runs in inference mode
    (no autograd bookkeeping on the few hundred small operations of a step).
    """
    with torch.inference_mode():
        return _compute_step(record, config, ws)


def _compute_step(record: "StepRecord", config: SignalConfig, ws: Workspace | None) -> Values:
    out = Pending()
    mask = record.mask
    B = record.batch_size
    device = mask.device
    per_seq = mask.sum(-1)                                                     # [B] response lengths
    if not token_signals(out, record, config, ws):
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
    groups = group_zero_var = None
    ok_reward = ok
    if record.rewards is not None:
        # A NaN or infinite reward is counted and its episode excluded from every reward signal (as
        # a failed episode is), never read as 0.
        finite = torch.isfinite(record.rewards)
        nonfinite = (ok & ~finite).sum()
        out.put("nonfinite_rewards", nonfinite)
        out.put("nonfinite_rewards_total", nonfinite)
        ok_reward = ok & finite
        reward_signals(out, record.rewards, ok_reward)
        if record.group_ids is not None:
            groups = group_index(record.group_ids)
            group_zero_var = group_signals(out, record.rewards, groups, ok_reward, config)
    lengths = length_signals(out, mask, record.truncated, per_seq)
    if record.entropy is not None:
        entropy_signal(out, record.entropy, mask)
    if record.env_index is not None:
        env_signals(out, record.env_index, record.env_names, record.rewards, ok_reward, record.truncated,
                    groups, group_zero_var, record.hacked, lengths)
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
    from ..errors import HookErrors
    from ..record import RecordBuilder

    config = config or SignalConfig()
    step = fields.pop("step", 0)
    builder = RecordBuilder(HookErrors(strict=True))
    ws = Workspace()
    record = builder.build(step, fields, ws)
    assert record is not None
    return compute_step(record, config, ws)
