"""Sampler-learner mismatch and importance-sampling health from the token log-probs (the in-place path).

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

import torch

from . import settings
from ..metrics import PROB_BIN_EDGES, PROB_BIN_LABELS
from .pending import Pending, _div
from .reduce import (ABS_FIRST, ABS_NBINS, ABS_SHIFT, _abs_bin_values, _dot, bin_counts, masked_quantiles,
                     quantile_from_counts)
from .settings import SAFETY_BOUND, SignalConfig, Workspace

# Exact strict comparisons without boolean tensors: (x - t) * 2**64 is >= 1 in magnitude whenever
# x != t (for |t| > 2**-60), so clamping it to [0, 1] gives the 0/1 indicator of x > t.
_SCALE = 2.0 ** 64


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


def _ratio_of(r: float, n: float) -> float | None:
    """exp(r) with r clamped to [-SAFETY_BOUND, SAFETY_BOUND], or None without valid tokens."""
    return math.exp(min(max(r, -SAFETY_BOUND), SAFETY_BOUND)) if n > 0 else None


def importance_ratio_signals(out: Pending, r: torch.Tensor, valid: torch.Tensor, sum_em1: torch.Tensor,
                             n: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Minimum, mean and maximum of the token importance ratio w = exp(r) over the valid tokens (r clamped
    to [-SAFETY_BOUND, SAFETY_BOUND] as everywhere): what TRL logs as sampling/importance_sampling_ratio/*
    before its correction truncates or masks. r, valid: [B, T], r 0 and valid 0 off the valid set;
    sum_em1: sum of exp(r) - 1 over them; n: their count; ``scratch``: two [B, T] buffers of r's dtype
    to overwrite. Exp on the host."""
    if r.numel():
        # r + big off the valid set (exactly r on it) for the minimum, r - big for the maximum: plain
        # arithmetic passes, several times cheaper on CPU than torch.where with a boolean mask. A valid
        # r beyond big (~1e37 nats) would read as big, which the clamp to SAFETY_BOUND makes the same ratio.
        big = torch.finfo(r.dtype).max / 4
        invalid, shifted = scratch if scratch is not None else (torch.empty_like(r), torch.empty_like(r))
        torch.sub(valid, 1.0, out=invalid).neg_()                               # 1 off the valid set
        low = torch.add(r, invalid, alpha=big, out=shifted).amin()
        high = shifted.sub_(invalid, alpha=2 * big).amax()
    else:
        low = high = torch.zeros((), dtype=r.dtype, device=r.device)
    out.derive("is_ratio_min", _ratio_of, low, n)
    out.derive("is_ratio_max", _ratio_of, high, n)
    out.derive("is_ratio_mean", lambda s, count: _div(count + s, count), sum_em1, n)


def mismatch_signals(out: Pending, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
                     mask: torch.Tensor, config: SignalConfig, ws: Workspace | None = None,
                     tokens: torch.Tensor | None = None) -> None:
    """Sampler-learner mismatch and importance-sampling health, in place in reused buffers.

    trainer_logp, sampler_logp: [B, T] log-probs of the sampled tokens (nats); mask: [B, T] float 0/1;
    tokens: mask.sum() if the caller has it.

    Four [B, T] buffers of the workspace serve every formula; each helper below names the one it
    writes for what it holds there, and says which buffer it overwrites. In order of use:
    ``r_s``: r and the valid sampler log-probs s side by side (the slope's two dot products are one
    matrix-vector product); ``a_valid``: |r| and the valid 0/1 mask side by side (one product per
    probability band); ``em1``: w - 1, then the scaled -log mu; ``tmp``: per-formula scratch.
    """
    ws = ws or Workspace()
    shape, device = mask.shape, mask.device
    work = torch.float64 if trainer_logp.dtype == torch.float64 else torch.float32
    r_and_s = ws.get("r_s", (2, *shape), work, device)
    abs_and_valid = ws.get("a_valid", (2, *shape), work, device)
    r, valid = r_and_s[0], abs_and_valid[1]
    nonfinite = _log_ratio(r, valid, trainer_logp, sampler_logp, mask, work)
    n = (mask.sum() if tokens is None else tokens) - nonfinite
    out.put("nonfinite_tokens", nonfinite)
    out.put("nonfinite_tokens_total", nonfinite)
    out.put("mismatch_tokens", n)
    out.put("mismatch_tokens_total", n)
    sum_r, max_a = _log_ratio_moments(out, r, abs_and_valid[0], n)
    scratch = ws.get("tmp", shape, work, device)
    w_minus_1 = torch.clamp(r, -SAFETY_BOUND, SAFETY_BOUND, out=ws.get("em1", shape, work, device)).expm1_()
    sum_em1 = _weight_moments(out, r, w_minus_1, scratch, config.is_cap, n)
    importance_ratio_signals(out, r, valid, sum_em1, n, scratch=(scratch, r_and_s[1]))
    _weight_threshold_counts(out, w_minus_1, scratch, config, n)
    neg_log_mu_scaled = _log_ratio_slope(out, r_and_s, sampler_logp, valid, sum_r, n, into=w_minus_1)
    _sequence_signals(out, r, valid, config)
    _abs_log_ratio_by_prob(out, abs_and_valid, neg_log_mu_scaled, scratch=(scratch, r, r_and_s[1]))
    _abs_log_ratio_quantiles(out, abs_and_valid, n, max_a, ws, spare=neg_log_mu_scaled)


def _log_ratio(r: torch.Tensor, valid: torch.Tensor, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
               mask: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """Writes r = trainer_logp - sampler_logp (0 off the valid set) and valid (1 on masked tokens with
    a finite r); returns the count of masked tokens whose r is not finite. r, valid: [B, T] buffers."""
    if trainer_logp.dtype == work and sampler_logp.dtype == work:
        torch.sub(trainer_logp, sampler_logp, out=r)                         # [B, T]
    else:
        r.copy_(trainer_logp).sub_(sampler_logp.to(work))
    nonfinite_masked = torch.sub(r, r, out=valid).nan_to_num_(nan=1.0).mul_(mask)   # valid's buffer, for now
    nonfinite = nonfinite_masked.sum()
    torch.sub(mask, nonfinite_masked, out=valid)                              # masked and finite: 0/1
    r.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(mask)                # 0 off the valid set
    return nonfinite


def _log_ratio_moments(out: Pending, r: torch.Tensor, abs_r: torch.Tensor,
                       n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean log-ratio, k1, k2 and the mean and max of |r| (written into the buffer ``abs_r``); every
    ratio is finished on the host. Returns sum(r) and max |r| (0 on an empty step)."""
    sum_r = r.sum()
    out.ratio("mismatch_log_ratio_mean", sum_r, n)
    out.derive("mismatch_kl_k1", lambda s, n: _div(-s, n), sum_r, n)
    out.derive("mismatch_kl_k2", lambda rr, n: _div(0.5 * rr, n), _dot(r, r), n)
    torch.abs(r, out=abs_r)
    max_a = abs_r.amax() if r.numel() else torch.zeros((), dtype=r.dtype, device=r.device)
    out.ratio("mismatch_abs_log_ratio_mean", abs_r.sum(), n)
    out.derive("mismatch_abs_log_ratio_max", lambda m, n: m if n > 0 else None, max_a, n)
    return sum_r, max_a


def _weight_moments(out: Pending, r: torch.Tensor, w_minus_1: torch.Tensor, scratch: torch.Tensor,
                    cap: float, n: torch.Tensor) -> torch.Tensor:
    """k3, token chi2 and the effective sample sizes (raw and truncated at ``cap``) from
    w - 1 = expm1(clamped r), 0 off the valid set. Overwrites ``scratch``. Returns sum(w - 1)."""
    k3_terms = torch.sub(w_minus_1, r, out=scratch)
    out.ratio("mismatch_kl_k3", k3_terms.sum(), n)
    sum_em1, sq_em1 = w_minus_1.sum(), _dot(w_minus_1, w_minus_1)
    out.derive("mismatch_chi2_token", lambda s, sq, n: _div(sq + 2 * s, n), sum_em1, sq_em1, n)  # mean(w^2 - 1)
    out.derive("is_ess_raw_ratio", _ess_ratio, sum_em1, sq_em1, n)
    truncated_minus_1 = torch.clamp(w_minus_1, max=cap - 1.0, out=scratch)    # min(w, C) - 1
    out.derive("is_ess_ratio", _ess_ratio, truncated_minus_1.sum(), _dot(truncated_minus_1, truncated_minus_1), n)
    return sum_em1


def _weight_threshold_counts(out: Pending, w_minus_1: torch.Tensor, scratch: torch.Tensor, config: SignalConfig,
                             n: torch.Tensor) -> None:
    """Tokens with w > C, w < 1/C and w outside the MIS band, exact and strict (see _SCALE).
    Scales ``w_minus_1`` in place (it is not read afterwards) and overwrites ``scratch``."""
    scaled = w_minus_1.mul_(_SCALE)
    counted: dict[tuple[str, float], torch.Tensor] = {}

    def count(side: str, threshold: float) -> torch.Tensor:   # thresholds are often shared (1/C = low)
        key = (side, threshold)
        if key not in counted:
            diff = torch.sub(scaled, threshold * _SCALE, out=scratch)
            counted[key] = diff.clamp_(0.0, 1.0).sum() if side == ">" else -diff.clamp_(-1.0, 0.0).sum()
        return counted[key]

    cap, (mis_low, mis_high) = config.is_cap, config.mis_band
    high, low = count(">", cap - 1.0), count("<", 1.0 / cap - 1.0)
    mis_below, mis_above = count("<", mis_low - 1.0), count(">", mis_high - 1.0)
    out.ratio("is_tis_high_ratio", high, n)
    out.ratio("is_tis_low_ratio", low, n)
    out.derive("is_mis_masked_ratio", lambda lo, hi, n: _div(lo + hi, n), mis_below, mis_above, n)
    out.put("is_tis_truncated_tokens_total", high)
    out.derive("is_mis_masked_tokens_total", operator.add, mis_below, mis_above)


def _log_ratio_slope(out: Pending, r_and_s: torch.Tensor, sampler_logp: torch.Tensor, valid: torch.Tensor,
                     sum_r: torch.Tensor, n: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """Slope of r against log mu over valid tokens (a temperature mismatch makes r linear in log mu).
    Writes s = log mu on the valid set into ``r_and_s[1]``; returns -s * _SCALE, written ``into`` the
    given buffer, for the probability bands."""
    s_valid = torch.mul(sampler_logp, valid, out=r_and_s[1]).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    out.derive("mismatch_log_ratio_slope", _slope, torch.mv(r_and_s.view(2, -1), s_valid.reshape(-1)),
               s_valid.sum(), sum_r, n)
    return torch.mul(s_valid, -_SCALE, out=into)


def _sequence_signals(out: Pending, r: torch.Tensor, valid: torch.Tensor, config: SignalConfig) -> None:
    """Sequence level: s_b = sum_t r, weight exp(s_b), over sequences with at least one valid token.
    The per-sequence terms are stacked and summed over those sequences in one matrix-vector product."""
    seq_r = r.sum(-1).double()                                                # [B]
    has = (valid.sum(-1) > 0).to(torch.float64)                               # [B]
    seq_abs = seq_r.abs()
    log_cap, (mis_low, mis_high) = math.log(config.is_cap), config.mis_band
    terms = torch.stack([has, seq_abs, torch.expm1(2 * seq_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)),
                         seq_r > log_cap, seq_r < -log_cap,
                         (seq_r < math.log(mis_low)) | (seq_r > math.log(mis_high))])   # [6, B]
    seq_sums = torch.mv(terms.to(torch.float64), has)     # n_seq, then the sums of the five terms
    for i, name in enumerate(("mismatch_seq_log_ratio_abs_mean", "mismatch_chi2_sequence", "is_seq_tis_high_ratio",
                              "is_seq_tis_low_ratio", "is_seq_mis_masked_ratio"), start=1):
        out.derive(name, lambda sums, i=i: _div(sums[i], sums[0]), seq_sums)
    seq_max = (seq_abs * has).amax() if seq_abs.numel() else seq_abs.sum()
    out.derive("mismatch_seq_log_ratio_abs_max", lambda m, sums: m if sums[0] > 0 else None, seq_max, seq_sums)


def _abs_log_ratio_by_prob(out: Pending, abs_and_valid: torch.Tensor, neg_log_mu_scaled: torch.Tensor,
                           scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Mean |r| and tokens by sampler probability: dot products of [|r|, valid] with the 0/1 indicator
    of each probability band (per band rather than as differences of cumulative sums, which lose
    float32 precision). ``scratch``: three [B, T] buffers no longer needed, overwritten."""
    below, previous, band = scratch        # [log mu < this edge], [log mu < the previous edge], the band
    band_sums = []
    for i, edge in enumerate((*PROB_BIN_EDGES, None)):
        if edge is not None:
            torch.add(neg_log_mu_scaled, math.log(edge) * _SCALE, out=below).clamp_(0.0, 1.0)
            indicator = below if i == 0 else torch.sub(below, previous, out=band)
        else:
            indicator = previous.neg_().add_(1.0)                              # [log mu >= last edge]
        band_sums.append(torch.mv(abs_and_valid.view(2, -1), indicator.reshape(-1)))  # [sum of |r|, tokens]
        below, previous = previous, below
    by_band = torch.stack(band_sums)                                          # [bands, 2]
    rows = [(label,) for label in PROB_BIN_LABELS]
    out.derive_vector("mismatch_abs_log_ratio_by_prob",
                      lambda flat: [_div(flat[k], flat[k + 1]) for k in range(0, len(flat), 2)], rows, by_band)
    out.derive_vector("mismatch_tokens_by_prob", lambda flat: flat[1::2], rows, by_band)


def _abs_log_ratio_quantiles(out: Pending, abs_and_valid: torch.Tensor, n: torch.Tensor, max_a: torch.Tensor,
                             ws: Workspace, spare: torch.Tensor) -> None:
    """|r| p50 and p99: exact (one sort) on small steps, where the histogram's 16k bins would cost
    more than the step's other signals; else from the bit-pattern histogram (bin 0 holds the zeros
    off the valid set), whose cost grows linearly with the tokens. ``spare``: a [B, T] buffer no
    longer needed, whose bits hold the float32 bins."""
    abs_r, valid = abs_and_valid[0], abs_and_valid[1]
    n_all = abs_r.numel()
    if n_all <= settings.EXACT_QUANTILE_MAX_TOKENS:
        quantiles = masked_quantiles(abs_r, valid, n, (0.5, 0.99))
    else:
        f32 = torch.float32
        a32 = abs_r if abs_r.dtype == f32 else abs_r.clamp(max=float(torch.finfo(f32).max)).to(f32)
        bins_out = (spare.view(torch.int32) if spare.dtype == f32
                    else ws.get("bins", abs_r.shape, torch.int32, abs_r.device))
        bins = torch.bitwise_right_shift(a32.view(torch.int32), ABS_SHIFT, out=bins_out)   # 0 .. 65535
        every = bin_counts(bins, 1 << (31 - ABS_SHIFT))
        last = ABS_FIRST + ABS_NBINS - 2                 # below 2^-40 -> bin 0, from 2^24 -> top bin
        hist = torch.cat([every[:ABS_FIRST].sum().reshape(1), every[ABS_FIRST:last],
                          every[last:].sum().reshape(1)])
        hist[0] -= n_all - n.double()
        quantiles = quantile_from_counts(hist, _abs_bin_values(abs_r.device, max_a), n, (0.5, 0.99))
    for i, name in enumerate(("mismatch_abs_log_ratio_p50", "mismatch_abs_log_ratio_p99")):
        out.derive(name, lambda qs, m, i=i: min(qs[i], m), quantiles, max_a)     # a bin's midpoint <= max
