"""The token-level quantities: the per-token terms (:data:`TERMS`), the sums over the valid tokens
(:data:`TOKEN_SUMS`), the thresholds they are compared against (:data:`SIGNAL_THRESHOLDS`), and the
catalogue families with their host formulas (:data:`METRICS`, which also holds the sequence-level
families: they read the same vector).

A new token signal is one block at the end of this file (``docs/adding-a-signal.md``): its sum (and
term, when none of :data:`TERMS` is what it sums), its metric with its catalogue entry (``help``,
``section``) and, when it has one, its threshold.

Conventions: ``r = log pi_old - log mu`` (nats), ``w = exp(r)`` with r clamped to
[-SAFETY_BOUND, SAFETY_BOUND] (as verl), ``s = log mu``; every term is 0 off the valid set, so
that sums need no mask. k3 and chi2 use ``expm1`` (non-negative and accurate when the mismatch is
tiny). A ratio whose denominator counts no item resolves to None.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import torch

from ..pending import _div
from ..buckets import LAG_BINS, SAFETY_BOUND
from .declare import Metric, Threshold, TokenSum

#: Per-token terms of ``t``: the valid-set tensors (keep 0/1, r, s, w_minus_1 = w - 1: [B, T], 0 off the set),
#: every device constant of :data:`SIGNAL_THRESHOLDS` by name (0-d; ``cap`` = C too) and ``out`` (None or the
#: engine's term buffer to fill).
TERMS: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "keep": lambda t: t["keep"],
    "r": lambda t: t["r"],
    "s": lambda t: t["s"],
    "w_minus_1": lambda t: t["w_minus_1"],
    "abs_r": lambda t: t["abs_r"] if "abs_r" in t else torch.abs(t["r"], out=t.get("out")),
    "w_truncated_minus_1": lambda t: torch.clamp(t["w_minus_1"], max=t["cap_minus_1"], out=t.get("out")),
    "k3": lambda t: torch.sub(t["w_minus_1"], t["r"], out=t.get("out")),                          # w - 1 - r
    "w": lambda t: torch.add(t["w_minus_1"], t["keep"], out=t.get("out")),
    "w_truncated": lambda t: torch.add(t["w_minus_1"], t["keep"], out=t.get("out")).clamp_(max=t["cap"]),  # min(w, C)
    "r_times_s": lambda t: torch.mul(t["r"], t["s"], out=t.get("out")),
}

#: The signals' configurable thresholds (each a keyword of SignalConfig, WatchConfig and Watch, an
#: RLWATCH_<NAME> variable, a config gauge and a row of the runbook's "Signal settings"); ``device``: the
#: constants the sums compare against, by name (C the TIS cap, [low, high] the MIS band).
SIGNAL_THRESHOLDS: tuple[Threshold, ...] = (
    Threshold("staleness_bound", 4.0, "Lag (policy updates) above which a token counts as over-stale.",
              help="Configured staleness bound (policy updates).",
              device={"over_from": lambda bound: math.floor(bound) + 1.0}),      # the smallest lag over it
    Threshold("is_cap", 2.0, "Truncated-IS cap C: tokens with w > C are truncated, w < 1/C counted as low.",
              above=1.0, help="Configured truncated-IS cap C.",
              device={"cap_minus_1": lambda c: c - 1.0, "inv_cap_minus_1": lambda c: 1.0 / c - 1.0,
                      "log_cap": math.log, "neg_log_cap": lambda c: -math.log(c)}),
    Threshold("mis_band", doc="Masked-IS band [low, high]: tokens with w outside it are masked.",
              parts=(Threshold("mis_low", 0.5, "Configured lower edge of the masked-IS band.", above=0.0, below=1.0),
                     Threshold("mis_high", 5.0, "Configured upper edge of the masked-IS band.", above=1.0)),
              device={"low_minus_1": lambda low, high: low - 1.0, "high_minus_1": lambda low, high: high - 1.0,
                      "log_low": lambda low, high: math.log(low), "log_high": lambda low, high: math.log(high)}),
)

#: The token sums. The first two must be the valid tokens and the sum of r: the sequence block
#: reads their per-sequence sums.
TOKEN_SUMS: tuple[TokenSum, ...] = (
    TokenSum("n", "keep"), TokenSum("sum_r", "r"), TokenSum("sum_s", "s"), TokenSum("sum_w_minus_1", "w_minus_1"),
    TokenSum("sum_w", "w"), TokenSum("sum_w_truncated", "w_truncated"), TokenSum("sum_abs_r", "abs_r"),
    TokenSum("sum_k3", "k3"), TokenSum("sum_r_times_s", "r_times_s"),
    TokenSum("sum_sq_r", "r", square=True), TokenSum("sum_sq_s", "s", square=True),
    TokenSum("sum_sq_w_minus_1", "w_minus_1", square=True),
    TokenSum("sum_sq_w", "w", square=True), TokenSum("sum_sq_w_truncated", "w_truncated", square=True),
    TokenSum("high", "w_minus_1", against="cap_minus_1"),
    TokenSum("low", "w_minus_1", against="inv_cap_minus_1", above=False),
    TokenSum("mis_below", "w_minus_1", against="low_minus_1", above=False),
    TokenSum("mis_above", "w_minus_1", against="high_minus_1"),
    TokenSum("band_abs", "abs_r", by="band"), TokenSum("band_n", "keep", by="band"),
    TokenSum("lag_k3", "k3", by="lag"), TokenSum("lag_abs", "abs_r", by="lag"), TokenSum("lag_n", "keep", by="lag"),
)

#: Fields after the sums: the extremes over the valid tokens (max r, max -r, max |r|; -inf without
#: any), the largest |s_b| and the |r| quantiles.
MISMATCH_TAIL = ("max_r", "max_neg_r", "max_abs_r", "max_abs_seq_r", "abs_r_p50", "abs_r_p99")
#: The lag block: cumulative counts at the histogram buckets (a slice), tokens of non-negative lag,
#: the sum of the cumulative counts over lags 0 .. LAG_EXACT_MAX (LAG_BINS n_ok minus the lag sum),
#: tokens over the staleness bound, lag p50 and p99, sequences with a token, the sum of their
#: largest lags, those spanning versions, the largest lag.
LAG_FIELDS = ("lag_cum", "n_ok", "cum_sum", "over", "lag_p50", "lag_p99", "lag_seq_n", "lag_seq_max_sum", "spans",
              "lag_max")


def ess_ratio(sum_w: float, sum_w2: float, n: float) -> float | None:
    """Effective sample size / n of weights w from sum(w), sum(w^2) and n (summed directly, not as
    n + sum(w - 1): that cancels when the weights are tiny); (sum w)^2 <= n sum w^2 (Cauchy-Schwarz),
    so the cap at 1 only removes float rounding."""
    ratio = _div(sum_w * sum_w, n * sum_w2)
    return None if ratio is None else min(ratio, 1.0)


def slope(f: SimpleNamespace) -> float | None:
    """Least-squares slope of r on s; None when s is (numerically) constant."""
    var_s = f.n * f.sum_sq_s - f.sum_s * f.sum_s
    return (f.n * f.sum_r_times_s - f.sum_s * f.sum_r) / var_s if var_s > 1e-9 * f.n * f.n else None


def _ratio_of(r: float, n: float) -> float | None:
    """exp(r) with r clamped to [-SAFETY_BOUND, SAFETY_BOUND], or None without valid tokens."""
    return math.exp(min(max(r, -SAFETY_BOUND), SAFETY_BOUND)) if n > 0 else None


def _if_any(value: float, n: float) -> float | None:
    return value if n > 0 else None


def _quantile(f: SimpleNamespace, q: float) -> float | None:
    """A bin's midpoint never exceeds the maximum it stands for."""
    return min(q, f.max_abs_r) if f.n > 0 and math.isfinite(q) else None


def _lag_sum(f: SimpleNamespace) -> float:
    return LAG_BINS * f.n_ok - f.cum_sum


def _lag_bucket(f: SimpleNamespace, k: int) -> float:
    """Tokens in the k-th histogram bucket (the last: above the largest bound)."""
    cum = [0.0, *f.lag_cum, f.n_ok]
    return cum[k + 1] - cum[k]


METRICS: tuple[Metric, ...] = (
    Metric("tokens", lambda f: f.tokens, "tokens",
           help="Response tokens the trainer trains on in the latest step (mask sum).", section="step"),
    Metric("tokens_total", lambda f: f.tokens, "tokens",
           help="Response tokens observed (mask sum).", section="step"),
    Metric("nonfinite_tokens", lambda f: f.tokens - f.n,
           help="Response tokens whose sampler or trainer log-prob is NaN or infinite.", section="mismatch"),
    Metric("nonfinite_tokens_total", lambda f: f.tokens - f.n,
           help="Response tokens with a NaN or infinite log-prob, excluded from the mismatch.", section="mismatch"),
    Metric("mismatch_tokens", lambda f: f.n,
           help="Tokens with finite sampler and trainer log-probs in the latest step.", section="mismatch"),
    Metric("mismatch_tokens_total", lambda f: f.n,
           help="Tokens with finite sampler and trainer log-probs.", section="is"),
    Metric("mismatch_log_ratio_mean", lambda f: _div(f.sum_r, f.n),
           help="Mean signed log-ratio r = trainer_logp - sampler_logp (nats).", section="mismatch"),
    Metric("mismatch_kl_k1", lambda f: _div(-f.sum_r, f.n),
           help="KL(mu||pi_old) estimator k1 = mean(-r) (verl rollout_corr/kl).", section="mismatch"),
    Metric("mismatch_kl_k2", lambda f: _div(0.5 * f.sum_sq_r, f.n),
           help="KL(mu||pi_old) estimator k2 = mean(r^2/2).", section="mismatch"),
    Metric("mismatch_kl_k3", lambda f: _div(f.sum_k3, f.n),
           help="KL(mu||pi_old) estimator k3 = mean(exp(r) - 1 - r) (verl rollout_corr/k3_kl).", section="mismatch"),
    Metric("mismatch_abs_log_ratio_mean", lambda f: _div(f.sum_abs_r, f.n),
           help="Mean |r| (nats).", section="mismatch"),
    Metric("mismatch_abs_log_ratio_max", lambda f: _if_any(f.max_abs_r, f.n),
           help="Maximum |r| (nats).", section="mismatch"),
    Metric("mismatch_abs_log_ratio_p50", lambda f: _quantile(f, f.abs_r_p50),
           help="Median |r| (nats).", section="mismatch"),
    Metric("mismatch_abs_log_ratio_p99", lambda f: _quantile(f, f.abs_r_p99),
           help="99th percentile of |r| (nats).", section="mismatch"),
    Metric("mismatch_chi2_token", lambda f: _div(f.sum_sq_w_minus_1 + 2 * f.sum_w_minus_1, f.n),      # mean(w^2 - 1)
           help="Token chi-square mean(w^2) - 1, w = exp(r) (verl rollout_corr/chi2_token).", section="mismatch"),
    Metric("mismatch_log_ratio_slope", slope,
           help="Least-squares slope of r against the sampler log-prob log mu. A sampler temperature T_s against the "
                "trainer's T_t makes r linear in log mu (slope near T_s/T_t - 1); numeric noise and staleness give a "
                "slope near 0.", section="mismatch"),
    Metric("is_ess_raw_ratio", lambda f: ess_ratio(f.sum_w, f.sum_sq_w, f.n),
           help="Normalised effective sample size of the raw weights w.", section="is"),
    Metric("is_ess_ratio", lambda f: ess_ratio(f.sum_w_truncated, f.sum_sq_w_truncated, f.n),
           help="Normalised effective sample size (sum w)^2 / (N sum w^2) of the TIS-truncated weights min(w, C) (verl "
                "rollout_is_eff_sample_size).", section="is"),
    Metric("is_ratio_min", lambda f: _ratio_of(-f.max_neg_r, f.n),
           help="Minimum token importance ratio w = exp(r) = pi_old / mu, before any truncation or masking (TRL "
                "sampling/importance_sampling_ratio/min in its token modes when nothing is clipped).", section="is"),
    Metric("is_ratio_max", lambda f: _ratio_of(f.max_r, f.n),
           help="Maximum token importance ratio w = exp(r), before any truncation or masking.", section="is"),
    Metric("is_ratio_mean", lambda f: _div(f.sum_w, f.n),
           help="Mean token importance ratio w = exp(r), before any truncation or masking.", section="is"),
    Metric("is_tis_high_ratio", lambda f: _div(f.high, f.n),
           help="Fraction of tokens with w > C, which a TIS cap truncates (verl rollout_is_ratio_fraction_high).",
           section="is"),
    Metric("is_tis_low_ratio", lambda f: _div(f.low, f.n),
           help="Fraction of tokens with w < 1/C (verl rollout_is_ratio_fraction_low).", section="is"),
    Metric("is_mis_masked_ratio", lambda f: _div(f.mis_below + f.mis_above, f.n),
           help="Fraction of tokens with w outside the MIS band [low, high], which MIS masks.", section="is"),
    Metric("is_tis_truncated_tokens_total", lambda f: f.high,
           help="Tokens with w > C (a TIS cap truncates them).", section="is"),
    Metric("is_mis_masked_tokens_total", lambda f: f.mis_below + f.mis_above,
           help="Tokens with w outside the MIS band (MIS masks them).", section="is"),
    Metric("mismatch_seq_log_ratio_abs_mean", lambda f: _div(f.seq_abs, f.seq_n),
           help="Mean over sequences of |sum of r over the sequence| (nats).", section="mismatch"),
    Metric("mismatch_seq_log_ratio_abs_max", lambda f: _if_any(f.max_abs_seq_r, f.seq_n),
           help="Maximum over sequences of |sum of r over the sequence| (nats).", section="mismatch"),
    Metric("mismatch_chi2_sequence", lambda f: _div(f.seq_chi2, f.seq_n),
           help="Sequence chi-square mean(exp(2 sum r)) - 1 (verl rollout_corr/chi2_seq).", section="mismatch"),
    Metric("is_seq_tis_high_ratio", lambda f: _div(f.seq_high, f.seq_n),
           help="Fraction of sequences whose weight exp(sum r) exceeds C.", section="is"),
    Metric("is_seq_tis_low_ratio", lambda f: _div(f.seq_low, f.seq_n),
           help="Fraction of sequences whose weight exp(sum r) is below 1/C.", section="is"),
    Metric("is_seq_mis_masked_ratio", lambda f: _div(f.seq_mis_below + f.seq_mis_above, f.seq_n),
           help="Fraction of sequences whose weight exp(sum r) is outside the MIS band.", section="is"),
    Metric("mismatch_abs_log_ratio_by_prob", lambda f, k: _div(f.band_abs[k], f.band_n[k]), by="band",
           help="Mean |r| by sampler probability of the token (nats).", section="mismatch"),
    Metric("mismatch_tokens_by_prob", lambda f, k: f.band_n[k], by="band",
           help="Tokens by sampler probability bin in the latest step.", section="mismatch"),
    Metric("mismatch_kl_k3_by_lag", lambda f, k: _div(f.lag_k3[k], f.lag_n[k]), "mismatch+lag", "lag",
           help="Token-weighted k3 = mean(exp(r) - 1 - r) over the tokens of each version-lag bucket (the lag "
                "histogram's buckets): the lag-0 level is the numerics floor, growth with lag is staleness.",
           section="mismatch"),
    Metric("mismatch_abs_log_ratio_mean_by_lag", lambda f, k: _div(f.lag_abs[k], f.lag_n[k]), "mismatch+lag", "lag",
           help="Mean |r| over the tokens of each version-lag bucket (nats).", section="mismatch"),
    Metric("mismatch_tokens_by_lag", lambda f, k: f.lag_n[k], "mismatch+lag", "lag",
           help="Tokens with finite log-probs and a non-negative version lag, by lag bucket, in the latest step.",
           section="mismatch"),
    Metric("negative_lag_tokens_total", lambda f: f.tokens - f.n_ok, "lag",
           help="Tokens left out of the lag signals as invalid input: a version newer than the trainer's, negative, "
                "NaN or infinite.", section="lag"),
    Metric("version_lag_mean", lambda f: _div(_lag_sum(f), f.n_ok), "lag",
           help="Mean per-token version lag (updates).", section="lag"),
    Metric("version_lag_max", lambda f: _if_any(f.lag_max, f.n_ok), "lag",
           help="Maximum per-token version lag (updates).", section="lag"),
    Metric("version_lag_p99", lambda f: _if_any(f.lag_p99, f.n_ok), "lag",
           help="99th percentile of the per-token version lag (updates).", section="lag"),
    Metric("version_lag_over_bound_ratio", lambda f: _div(f.over, f.n_ok), "lag",
           help="Fraction of tokens whose lag exceeds the staleness bound.", section="lag"),
    Metric("tokens_over_staleness_bound_total", lambda f: f.over, "lag",
           help="Tokens whose lag exceeded the staleness bound.", section="lag"),
    Metric("version_lag_sequence_max_mean", lambda f: _div(f.lag_seq_max_sum, f.lag_seq_n), "lag",
           help="Mean over sequences of each sequence's maximum token lag (updates).", section="lag"),
    Metric("partial_rollout_ratio", lambda f: _div(f.spans, f.lag_seq_n), "lag",
           help="Fraction of sequences whose tokens span more than one policy version.", section="lag"),
    Metric("partial_rollout_sequences_total", lambda f: f.spans, "lag",
           help="Sequences whose tokens span more than one policy version.", section="lag"),
    Metric("token_version_lag", _lag_bucket, "lag", "lag",
           help="Per-token policy-version lag (trainer version minus the version that generated the token).",
           section="lag", kind="histogram"),
    Metric("token_version_lag_sum", _lag_sum, "lag", kind="internal"),
)

# --- Signals added since, one block each (docs/adding-a-signal.md): ``TOKEN_SUMS += (...)``, ``METRICS += (...)``
# and, with a threshold, ``SIGNAL_THRESHOLDS += (...)``. ---------------------------------------------------------
