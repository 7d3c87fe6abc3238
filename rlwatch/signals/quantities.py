"""Every token-, sequence- and episode-level quantity of a step, declared once.

A :class:`TokenSum` names a sum over the step's *valid tokens* (masked, with a finite log-ratio r):
of a per-token term of :data:`TERMS`, of its square, of its comparison with a threshold, or split
by a per-token index (``by``: the sampler-probability band or the version-lag bucket, one sum per
label). A :class:`SeqSum` is the same over the sequences with a valid token. A :class:`Metric`
is a catalogue family (:mod:`rlwatch.core.metrics`) and its host formula from those sums, read by name.
An :class:`EpisodeRow` is a per-episode row (a term, what it needs, whether it is summed per
environment), a :class:`GroupRow` a row of one value per GRPO group (a term, or a constant group's
reward against a named threshold), and an episode :class:`Metric` a formula from the rows' sums.

:mod:`.fused` builds its device work from :data:`TOKEN_SUMS` and :data:`SEQ_SUMS` (eagerly as a
few stacked [k, B, T] groups reduced at once, compiled as one reduction per sum) and packs the
results in the order :func:`token_fields` gives; :func:`finish_tokens` applies :data:`METRICS` to
the transferred vector. :mod:`.episodes` stacks :data:`EPISODE_ROWS` and :data:`GROUP_ROWS` in the
order :func:`episode_layout` gives; :func:`finish_episodes` applies :data:`EPISODE_METRICS`. Adding
a quantity is a term (when new), a sum or a row, and a metric here, and its
:class:`~rlwatch.core.metrics.MetricSpec` in the catalogue (``docs/adding-a-signal.md``).

Conventions: ``r = log pi_old - log mu`` (nats), ``w = exp(r)`` with r clamped to
[-SAFETY_BOUND, SAFETY_BOUND] (as verl), ``s = log mu``; every term is 0 off the valid set, so
that sums need no mask. k3 and chi2 use ``expm1`` (non-negative and accurate when the mismatch is
tiny). A ratio whose denominator counts no item resolves to None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from .buckets import LAG_BUCKET_LABELS, PROB_BIN_LABELS, ZERO_VARIANCE_KINDS
from .derived import derive_hack_ratios
from .pending import Values, _div
from .reduce import plan
from .settings import LAG_BINS, SAFETY_BOUND

#: Per-token terms of ``t``: the valid-set tensors ([B, T], 0 off the set), ``cap`` C, ``out`` (None or a buffer).
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

#: The ``thresholds`` input of the fused function, by name: (C - 1, 1/C - 1, low - 1, high - 1, log C,
#: -log C, log low, log high, then the log-probability band edges), C the TIS cap, [low, high] the MIS band.
THRESHOLDS = ("cap_minus_1", "inv_cap_minus_1", "low_minus_1", "high_minus_1", "log_cap", "neg_log_cap", "log_low",
              "log_high", "edges")


@dataclass(frozen=True)
class TokenSum:
    """A sum over the valid tokens of ``term``: as is, ``square``d, counted where ``term`` is ``above``
    or below (``above=False``) the threshold named ``against``, or ``by`` "band"/"lag" (a slice)."""

    name: str
    term: str
    square: bool = False
    against: str = ""
    above: bool = True
    by: str = ""


@dataclass(frozen=True)
class SeqSum:
    """A sum over the sequences with a valid token of a per-sequence term (``has``: 1; ``abs``:
    |s_b|; ``chi2``: exp(2 s_b) - 1, s_b the sum of r over the sequence; ``s``: s_b, only compared
    with the threshold ``against``)."""

    name: str
    term: str
    against: str = ""
    above: bool = True


#: The token sums. The first two must be the valid tokens and the sum of r: the sequence block
#: reads their per-sequence sums.
TOKEN_SUMS: tuple[TokenSum, ...] = (
    TokenSum("n", "keep"), TokenSum("sum_r", "r"), TokenSum("s_sum", "s"), TokenSum("sum_em1", "w_minus_1"),
    TokenSum("sum_w", "w"), TokenSum("sum_wt", "w_truncated"), TokenSum("sum_a", "abs_r"), TokenSum("sum_k3", "k3"),
    TokenSum("rs", "r_times_s"), TokenSum("sum_r2", "r", square=True), TokenSum("ss", "s", square=True),
    TokenSum("sq_em1", "w_minus_1", square=True), TokenSum("sq_w", "w", square=True),
    TokenSum("sq_wt", "w_truncated", square=True), TokenSum("high", "w_minus_1", against="cap_minus_1"),
    TokenSum("low", "w_minus_1", against="inv_cap_minus_1", above=False),
    TokenSum("mis_below", "w_minus_1", against="low_minus_1", above=False),
    TokenSum("mis_above", "w_minus_1", against="high_minus_1"), TokenSum("band_abs", "abs_r", by="band"),
    TokenSum("band_n", "keep", by="band"), TokenSum("lag_k3", "k3", by="lag"), TokenSum("lag_abs", "abs_r", by="lag"),
    TokenSum("lag_n", "keep", by="lag"),
)

SEQ_SUMS: tuple[SeqSum, ...] = (
    SeqSum("seq_n", "has"), SeqSum("seq_abs", "abs"), SeqSum("seq_chi2", "chi2"),
    SeqSum("seq_high", "s", "log_cap"), SeqSum("seq_low", "s", "neg_log_cap", above=False),
    SeqSum("seq_mis_below", "s", "log_low", above=False), SeqSum("seq_mis_above", "s", "log_high"),
)

#: Labels of the ``by`` slices.
BY_LABELS: dict[str, tuple[str, ...]] = {"band": PROB_BIN_LABELS, "lag": LAG_BUCKET_LABELS, "kind": ZERO_VARIANCE_KINDS}

#: Fields after the sums: the extremes over the valid tokens (max r, -min r, max |r|; -inf without
#: any), the largest |s_b| and the |r| quantiles.
MISMATCH_TAIL = ("max_r", "neg_min_r", "max_a", "seq_max", "q50", "q99")
#: The lag block: cumulative counts at the histogram buckets (a slice), tokens of non-negative lag,
#: the sum of the cumulative counts over lags 0 .. LAG_EXACT_MAX (LAG_BINS n_ok minus the lag sum),
#: tokens over the staleness bound, lag p50 and p99, sequences with a token, the sum of their
#: largest lags, those spanning versions, the largest lag.
LAG_FIELDS = ("lag_cum", "n_ok", "cum_sum", "over", "lag_p50", "lag_p99", "lag_seq_n", "lag_seq_max_sum", "spans",
              "lag_max")


def token_sums(lag: bool) -> list[TokenSum]:
    """The token sums a step computes, in the order of the fused vector (the ``lag`` splits only with
    versions): plain sums, squares, threshold counts, then the ``by`` slices."""
    sums = [s for s in TOKEN_SUMS if lag or s.by != "lag"]
    by = list(dict.fromkeys(s.by for s in sums if s.by))
    return ([s for s in sums if not (s.square or s.against or s.by)] + [s for s in sums if s.square]
            + [s for s in sums if s.against] + sorted((s for s in sums if s.by), key=lambda s: by.index(s.by)))


def token_fields(mismatch: bool, lag: bool) -> list[tuple[str, int]]:
    """(name, width) of each field of the fused vector after ``tokens``; width 0 for a scalar."""
    fields: list[tuple[str, int]] = []
    if mismatch:
        fields += [(s.name, len(BY_LABELS[s.by]) if s.by else 0) for s in token_sums(lag)]
        fields += [(s.name, 0) for s in SEQ_SUMS] + [(name, 0) for name in MISMATCH_TAIL]
    if lag:
        fields += [(name, len(LAG_BUCKET_LABELS) - 1 if name == "lag_cum" else 0) for name in LAG_FIELDS]
    return fields


def fields(v: list[float], pos: dict[str, Any]) -> SimpleNamespace:
    """The fused vector's fields by name: ``f.n`` a float, ``f.band_abs`` a list (a ``by`` slice)."""
    return SimpleNamespace(**{name: v[at] for name, at in pos.items() if name != "size"})


@dataclass(frozen=True)
class Metric:
    """A catalogue family and its host formula ``fn(f)``, ``f`` the fields by name (:func:`fields`
    for a token metric; for an episode metric the sums of its rows, see :func:`finish_episodes`).
    ``needs``: the inputs it needs, joined by "+" ("tokens", "mismatch", "lag"; "episodes",
    "rewards", "groups", "envs", "truncated"). ``by``: one value per label, ``fn(f, k)`` for the
    k-th of :data:`BY_LABELS` ("band", "lag", "kind"); "env": ``fn(f)`` per environment with ``f``
    its sums of the ``per_env`` rows; "detector": ``fn(f, detector)`` per environment and detector."""

    name: str
    fn: Callable[..., float | None]
    needs: str = "mismatch"
    by: str = ""


def _needed(needs: str, have: set[str]) -> bool:
    return set(needs.split("+")) <= have


@plan(lambda: (METRICS, EPISODE_METRICS))
def _metrics(level: str, have: frozenset[str]) -> list[tuple[str, Callable[..., Any], str, list]]:
    """(name, formula, ``by``, [(k, labels)] of a ``by`` slice) of the token or episode metrics whose
    inputs are all in ``have``."""
    return [(m.name, m.fn, m.by, list(enumerate((label,) for label in BY_LABELS.get(m.by, ()))))
            for m in (METRICS if level == "tokens" else EPISODE_METRICS) if _needed(m.needs, have)]


def _apply(level: str, have: frozenset[str], f: SimpleNamespace,
           per_env: list[tuple[str, SimpleNamespace]] = (), detectors: list[str] = ()) -> Values:
    """The values of the ``level`` metrics whose inputs are all in ``have``."""
    out: Values = {}
    for name, fn, by, labels in _metrics(level, have):
        if by == "env":
            out[name] = {(env,): fn(fe) for env, fe in per_env}
        elif by == "detector":
            out[name] = {(env, d): fn(fe, d) for d in detectors for env, fe in per_env}
        elif by:
            out[name] = {label: fn(f, k) for k, label in labels}
        else:
            out[name] = {(): fn(f)}
    return out


def ess_ratio(sum_w: float, sum_w2: float, n: float) -> float | None:
    """Effective sample size / n of weights w from sum(w), sum(w^2) and n (summed directly, not as
    n + sum(w - 1): that cancels when the weights are tiny); (sum w)^2 <= n sum w^2 (Cauchy-Schwarz),
    so the cap at 1 only removes float rounding."""
    ratio = _div(sum_w * sum_w, n * sum_w2)
    return None if ratio is None else min(ratio, 1.0)


def slope(f: SimpleNamespace) -> float | None:
    """Least-squares slope of r on s; None when s is (numerically) constant."""
    var_s = f.n * f.ss - f.s_sum * f.s_sum
    return (f.n * f.rs - f.s_sum * f.sum_r) / var_s if var_s > 1e-9 * f.n * f.n else None


def _ratio_of(r: float, n: float) -> float | None:
    """exp(r) with r clamped to [-SAFETY_BOUND, SAFETY_BOUND], or None without valid tokens."""
    return math.exp(min(max(r, -SAFETY_BOUND), SAFETY_BOUND)) if n > 0 else None


def _if_any(value: float, n: float) -> float | None:
    return value if n > 0 else None


def _quantile(f: SimpleNamespace, q: float) -> float | None:
    """A bin's midpoint never exceeds the maximum it stands for."""
    return min(q, f.max_a) if f.n > 0 and math.isfinite(q) else None


def _lag_sum(f: SimpleNamespace) -> float:
    return LAG_BINS * f.n_ok - f.cum_sum


def _lag_bucket(f: SimpleNamespace, k: int) -> float:
    """Tokens in the k-th histogram bucket (the last: above the largest bound)."""
    cum = [0.0, *f.lag_cum, f.n_ok]
    return cum[k + 1] - cum[k]


METRICS: tuple[Metric, ...] = (
    Metric("tokens", lambda f: f.tokens, "tokens"),
    Metric("tokens_total", lambda f: f.tokens, "tokens"),
    Metric("nonfinite_tokens", lambda f: f.tokens - f.n),
    Metric("nonfinite_tokens_total", lambda f: f.tokens - f.n),
    Metric("mismatch_tokens", lambda f: f.n),
    Metric("mismatch_tokens_total", lambda f: f.n),
    Metric("mismatch_log_ratio_mean", lambda f: _div(f.sum_r, f.n)),
    Metric("mismatch_kl_k1", lambda f: _div(-f.sum_r, f.n)),
    Metric("mismatch_kl_k2", lambda f: _div(0.5 * f.sum_r2, f.n)),
    Metric("mismatch_kl_k3", lambda f: _div(f.sum_k3, f.n)),
    Metric("mismatch_abs_log_ratio_mean", lambda f: _div(f.sum_a, f.n)),
    Metric("mismatch_abs_log_ratio_max", lambda f: _if_any(f.max_a, f.n)),
    Metric("mismatch_abs_log_ratio_p50", lambda f: _quantile(f, f.q50)),
    Metric("mismatch_abs_log_ratio_p99", lambda f: _quantile(f, f.q99)),
    Metric("mismatch_chi2_token", lambda f: _div(f.sq_em1 + 2 * f.sum_em1, f.n)),      # mean(w^2 - 1)
    Metric("mismatch_log_ratio_slope", slope),
    Metric("is_ess_raw_ratio", lambda f: ess_ratio(f.sum_w, f.sq_w, f.n)),
    Metric("is_ess_ratio", lambda f: ess_ratio(f.sum_wt, f.sq_wt, f.n)),
    Metric("is_ratio_min", lambda f: _ratio_of(-f.neg_min_r, f.n)),
    Metric("is_ratio_max", lambda f: _ratio_of(f.max_r, f.n)),
    Metric("is_ratio_mean", lambda f: _div(f.sum_w, f.n)),
    Metric("is_tis_high_ratio", lambda f: _div(f.high, f.n)),
    Metric("is_tis_low_ratio", lambda f: _div(f.low, f.n)),
    Metric("is_mis_masked_ratio", lambda f: _div(f.mis_below + f.mis_above, f.n)),
    Metric("is_tis_truncated_tokens_total", lambda f: f.high),
    Metric("is_mis_masked_tokens_total", lambda f: f.mis_below + f.mis_above),
    Metric("mismatch_seq_log_ratio_abs_mean", lambda f: _div(f.seq_abs, f.seq_n)),
    Metric("mismatch_seq_log_ratio_abs_max", lambda f: _if_any(f.seq_max, f.seq_n)),
    Metric("mismatch_chi2_sequence", lambda f: _div(f.seq_chi2, f.seq_n)),
    Metric("is_seq_tis_high_ratio", lambda f: _div(f.seq_high, f.seq_n)),
    Metric("is_seq_tis_low_ratio", lambda f: _div(f.seq_low, f.seq_n)),
    Metric("is_seq_mis_masked_ratio", lambda f: _div(f.seq_mis_below + f.seq_mis_above, f.seq_n)),
    Metric("mismatch_abs_log_ratio_by_prob", lambda f, k: _div(f.band_abs[k], f.band_n[k]), by="band"),
    Metric("mismatch_tokens_by_prob", lambda f, k: f.band_n[k], by="band"),
    Metric("mismatch_kl_k3_by_lag", lambda f, k: _div(f.lag_k3[k], f.lag_n[k]), "mismatch+lag", "lag"),
    Metric("mismatch_abs_log_ratio_mean_by_lag", lambda f, k: _div(f.lag_abs[k], f.lag_n[k]), "mismatch+lag", "lag"),
    Metric("mismatch_tokens_by_lag", lambda f, k: f.lag_n[k], "mismatch+lag", "lag"),
    Metric("negative_lag_tokens_total", lambda f: f.tokens - f.n_ok, "lag"),
    Metric("version_lag_mean", lambda f: _div(_lag_sum(f), f.n_ok), "lag"),
    Metric("version_lag_max", lambda f: _if_any(f.lag_max, f.n_ok), "lag"),
    Metric("version_lag_p99", lambda f: _if_any(f.lag_p99, f.n_ok), "lag"),
    Metric("version_lag_over_bound_ratio", lambda f: _div(f.over, f.n_ok), "lag"),
    Metric("tokens_over_staleness_bound_total", lambda f: f.over, "lag"),
    Metric("version_lag_sequence_max_mean", lambda f: _div(f.lag_seq_max_sum, f.lag_seq_n), "lag"),
    Metric("partial_rollout_ratio", lambda f: _div(f.spans, f.lag_seq_n), "lag"),
    Metric("partial_rollout_sequences_total", lambda f: f.spans, "lag"),
    Metric("token_version_lag", _lag_bucket, "lag", "lag"),
    Metric("token_version_lag_sum", _lag_sum, "lag"),
)


@plan()
def _token_inputs(mismatch: bool, lag: bool) -> frozenset[str]:
    """The token-level inputs present: "tokens" (always) and those on."""
    return frozenset(name for name, on in (("tokens", True), ("mismatch", mismatch), ("lag", lag)) if on)


def finish_tokens(v: list[float], pos: dict[str, Any], mismatch: bool, lag: bool) -> Values:
    """:data:`METRICS` of the inputs present, from the fused vector ``v`` (positions ``pos``)."""
    return _apply("tokens", _token_inputs(mismatch, lag), fields(v, pos))


# --- episode-level quantities -----------------------------------------------------------------------

#: The response-length quantile (linear interpolation between order statistics, as torch.quantile).
LENGTH_QUANTILE = 0.99


@dataclass(frozen=True)
class EpisodeRow:
    """A row of the step's [K, B] per-episode matrix (:func:`.episodes.episode_core`), reduced to its
    sum and its maximum. ``term(e)``: the [B] row from the per-episode tensors ``e`` (``all_ok``: not
    failed, ``length``, ``truncated``; with rewards ``ok``: usable (not failed, finite reward), ``r``:
    the reward, 0 where unusable; with groups and environments ``pairs``, ``pairs_zero_var``) and the
    rows declared before it, by name. ``needs``: the inputs it needs ("episodes", always there;
    "rewards", "groups", "envs", "truncated", joined by "+"); ``per_env``: also summed per environment."""

    name: str
    term: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    needs: str = "episodes"
    per_env: bool = False


EPISODE_ROWS: tuple[EpisodeRow, ...] = (
    EpisodeRow("episodes", lambda e: torch.ones_like(e["length"]), per_env=True),
    EpisodeRow("all_ok", lambda e: e["all_ok"], "rewards"),
    EpisodeRow("length", lambda e: e["length"]),
    EpisodeRow("ok", lambda e: e["ok"], "rewards", per_env=True),
    EpisodeRow("r", lambda e: e["r"], "rewards", per_env=True),
    EpisodeRow("rr", lambda e: e["r"] * e["r"], "rewards", per_env=True),
    EpisodeRow("n", lambda e: e["length"] * e["ok"], "rewards+envs", per_env=True),     # usable lengths
    EpisodeRow("nn", lambda e: e["n"] * e["n"], "rewards+envs", per_env=True),
    EpisodeRow("rn", lambda e: e["r"] * e["n"], "rewards+envs", per_env=True),
    EpisodeRow("truncated", lambda e: e["truncated"], "truncated", per_env=True),
    # The episode represents a distinct (group, environment) pair; and that group is constant.
    EpisodeRow("pairs", lambda e: e["pairs"], "groups+envs", per_env=True),
    EpisodeRow("pairs_zero_var", lambda e: e["pairs_zero_var"], "groups+envs", per_env=True),
)

#: The group block's thresholds, in the device vector's order: the batch's highest usable reward, -lowest
#: (the layout's ``range``), then :func:`.episodes.bound_values`: pass, -fail, the smallest positive float64.
GROUP_THRESHOLDS = ("highest", "neg_lowest", "pass", "neg_fail", "positive")


@dataclass(frozen=True)
class GroupRow:
    """A row of the group block: one value per group slot (one per group id, B + 1 in all), reduced as
    an :class:`EpisodeRow`. ``term(g)``: the row from the per-slot tensors ``g`` (``exists``: a usable
    episode, ``zero_var``: a constant group, ``size``: usable episodes; ``B``, an int); without a term,
    the constant groups whose ``base`` ("ref": the group's reward, "neg": -ref) is >= the threshold of
    :data:`GROUP_THRESHOLDS` named ``at``."""

    name: str
    term: Callable[[dict[str, Any]], torch.Tensor] | None = None
    base: str = ""
    at: str = ""


#: Groups, constant groups, their usable episodes, sizes, B + 1 - size (0 for an empty slot: its maximum
#: gives the smallest group); constant groups at the batch's highest and lowest reward, at the configured
#: pass and fail rewards, and above 0.
GROUP_ROWS: tuple[GroupRow, ...] = (
    GroupRow("groups", lambda g: g["exists"]),
    GroupRow("zero_var", lambda g: g["zero_var"]),
    GroupRow("zero_var_episodes", lambda g: g["zero_var"] * g["size"]),
    GroupRow("size", lambda g: g["size"]),
    GroupRow("size_gap", lambda g: (g["B"] + 1 - g["size"]) * g["exists"]),
    GroupRow("range_pass", base="ref", at="highest"),
    GroupRow("range_fail", base="neg", at="neg_lowest"),
    GroupRow("bounds_pass", base="ref", at="pass"),
    GroupRow("bounds_fail", base="neg", at="neg_fail"),
    GroupRow("sign_pass", base="ref", at="positive"),
)


@plan(lambda: (GROUP_ROWS,))
def group_block() -> dict[str, Any]:
    """The group block: ``rows`` in the matrix's order, ``terms`` (those with a term) then ``kinds``
    (the threshold rows); ``at``, the position of each kind's threshold in :data:`GROUP_THRESHOLDS`,
    and ``index``, those positions as an index of the threshold vector (None: the whole vector)."""
    terms = [row for row in GROUP_ROWS if row.term is not None]
    kinds = [row for row in GROUP_ROWS if row.term is None]
    at = tuple(GROUP_THRESHOLDS.index(row.at) for row in kinds)
    return dict(rows=terms + kinds, terms=terms, kinds=kinds, at=at,
                index=None if at == tuple(range(len(GROUP_THRESHOLDS))) else list(at))


@plan()
def _episode_inputs(rewards: bool, groups: bool, envs: bool, truncated: bool) -> frozenset[str]:
    """The episode-level inputs present: "episodes" (always) and those on (groups only with rewards)."""
    return frozenset(name for name, on in (("episodes", True), ("rewards", rewards), ("groups", rewards and groups),
                                           ("envs", envs), ("truncated", truncated)) if on)


@plan(lambda: (EPISODE_ROWS, GROUP_ROWS))
def episode_rows(rewards: bool, groups: bool, envs: bool,
                 truncated: bool) -> tuple[list[EpisodeRow | GroupRow], list[EpisodeRow], int]:
    """The rows a step computes, in the matrix's order after the ``hacked`` rows (the episode rows
    summed per environment, the others, then :func:`group_block`); the episode rows in declaration
    order (a term may read an earlier row); and how many are summed per environment."""
    have = _episode_inputs(rewards, groups, envs, truncated)
    rows = [row for row in EPISODE_ROWS if _needed(row.needs, have)]
    block = group_block()["rows"] if "groups" in have else []
    return sorted(rows, key=lambda row: not row.per_env) + block, rows, sum(row.per_env for row in rows)


def episode_layout(rewards: bool, groups: bool, envs: int, truncated: bool, detectors: list[str]) -> dict[str, Any]:
    """Positions in :func:`.episodes.episode_core`'s output (``envs`` = E', the rows of the
    per-environment sums; 0 without environments): ``rows`` (the row names: ``hacked/<detector>``,
    then :func:`episode_rows`), ``have`` (the inputs), ``width`` (rows summed per environment), then
    slices of the output: ``sums`` [K], ``maxes`` [K], ``range`` (highest reward, -lowest; with
    groups), ``p99`` (the order statistics around the length quantile), ``env`` ([E', width] row-major).
    Read-only."""
    return _episode_layout(rewards, groups, envs, truncated, tuple(detectors))


@plan(lambda: (EPISODE_ROWS, GROUP_ROWS))
def _episode_layout(rewards: bool, groups: bool, envs: int, truncated: bool, detectors: tuple[str, ...]) -> dict:
    declared, _, per_env = episode_rows(rewards, groups, envs > 0, truncated)
    rows = ["hacked/" + d for d in detectors] + [row.name for row in declared]
    K, have = len(rows), _episode_inputs(rewards, groups, envs > 0, truncated)
    width = len(detectors) + per_env if envs else 0
    pos: dict[str, Any] = {"rows": rows, "max_rows": ["max_" + row for row in rows], "have": have, "width": width,
                           "sums": slice(0, K), "maxes": slice(K, 2 * K)}
    at = 2 * K
    if "groups" in have:
        pos["range"], at = slice(at, at + 2), at + 2
    pos["p99"], at = slice(at, at + 2), at + 2
    pos["env"], at = slice(at, at + envs * width), at + envs * width
    pos["size"] = at
    return pos


def _std(n: float, s: float, sq: float) -> float | None:
    """Population standard deviation from n, sum x, sum x^2."""
    return math.sqrt(max(sq / n - (s / n) ** 2, 0.0)) if n else None


def _length_quantile(f: SimpleNamespace) -> float | None:
    """The LENGTH_QUANTILE quantile from its two order statistics (the formula of torch.quantile)."""
    if not f.episodes:
        return None
    rank = LENGTH_QUANTILE * (f.episodes - 1)
    lo_value, hi_value = f.p99
    return lo_value + (rank - math.floor(rank)) * (hi_value - lo_value)


def _constant_kinds(f: SimpleNamespace) -> tuple[float, float, float]:
    """Constant groups passing, failing and other. Classified by the configured (fail, pass)
    rewards, else by the batch's range (a constant group at its highest reward passes, at its
    lowest fails); when these do not span an interval (one constant batch), by sign."""
    if f.bounds is not None:
        fail, passing = f.bounds
        rule = "bounds" if passing > fail else "sign"
    else:
        highest, neg_lowest = f.range
        rule = "range" if highest > -neg_lowest else "sign"
    at_pass = getattr(f, rule + "_pass")
    at_fail = f.zero_var - at_pass if rule == "sign" else getattr(f, rule + "_fail")
    return at_pass, at_fail, f.zero_var - at_pass - at_fail


def _corr(f: SimpleNamespace) -> float | None:
    """Pearson correlation of reward with response length (usable episodes; None under 4)."""
    var = (f.ok * f.rr - f.r * f.r) * (f.ok * f.nn - f.n * f.n)
    return (f.ok * f.rn - f.r * f.n) / math.sqrt(max(var, 1e-300)) if f.ok >= 4 and var > 0 else None


EPISODE_METRICS: tuple[Metric, ...] = (
    Metric("nonfinite_rewards", lambda f: f.all_ok - f.ok, "rewards"),
    Metric("nonfinite_rewards_total", lambda f: f.all_ok - f.ok, "rewards"),
    Metric("reward_mean", lambda f: _div(f.r, f.ok), "rewards"),
    Metric("reward_std", lambda f: _std(f.ok, f.r, f.rr), "rewards"),
    Metric("groups", lambda f: f.groups, "groups"),
    Metric("groups_total", lambda f: f.groups, "groups"),
    Metric("zero_variance_groups_ratio", lambda f, k: _div(_constant_kinds(f)[k], f.groups), "groups", "kind"),
    Metric("zero_variance_groups_total", lambda f, k: _constant_kinds(f)[k], "groups", "kind"),
    Metric("zero_gradient_episodes_ratio", lambda f: _div(f.zero_var_episodes, f.ok), "groups"),
    Metric("_group_size_min", lambda f: f.episodes + 1 - f.max_size_gap if f.max_size_gap > 0 else None, "groups"),
    Metric("_group_size_max", lambda f: f.max_size, "groups"),
    Metric("response_length_mean", lambda f: _div(f.length, f.episodes), "episodes"),
    Metric("response_length_max", lambda f: f.max_length, "episodes"),
    Metric("response_length_p99", _length_quantile, "episodes"),
    Metric("truncated_ratio", lambda f: _div(f.truncated, f.episodes), "truncated"),
    Metric("env_episodes", lambda f: f.episodes, "envs", "env"),
    Metric("episodes_total", lambda f: f.episodes, "envs", "env"),
    Metric("env_reward_mean", lambda f: _div(f.r, f.ok), "rewards+envs", "env"),
    Metric("env_reward_length_corr", _corr, "rewards+envs", "env"),
    Metric("env_truncated_ratio", lambda f: _div(f.truncated, f.episodes), "truncated+envs", "env"),
    Metric("episodes_truncated_total", lambda f: f.truncated, "truncated+envs", "env"),
    Metric("env_zero_variance_groups_ratio", lambda f: _div(f.pairs_zero_var, f.pairs), "groups+envs", "env"),
    Metric("episodes_hacked_total", lambda f, d: f.hacked[d], "envs", "detector"),
    Metric("episodes_judged_total", lambda f, d: f.episodes, "envs", "detector"),
)


def _episode_fields(names: list[str], sums: list[float], detectors: list[str], **more: Any) -> SimpleNamespace:
    """The rows' sums by name, and by detector those of the ``hacked/<detector>`` rows (the first)."""
    return SimpleNamespace(**dict(zip(names, sums)), hacked=dict(zip(detectors, sums)), **more)


def finish_episodes(v: list[float], pos: dict[str, Any], envs: list[str], detectors: list[str],
                    reward_bounds: tuple[float, float] | None = None) -> Values:
    """:data:`EPISODE_METRICS` of the inputs present, from :func:`.episodes.episode_core`'s vector
    ``v`` (``reward_bounds``: the configured (fail, pass) rewards, None when inferred per batch)."""
    names, width, env = pos["rows"], pos["width"], v[pos["env"]]
    f = _episode_fields(names, v[pos["sums"]], detectors, **dict(zip(pos["max_rows"], v[pos["maxes"]])),
                        range=v[pos["range"]] if "range" in pos else None, p99=v[pos["p99"]], bounds=reward_bounds)
    per_env = [(name, _episode_fields(names[:width], env[e * width:(e + 1) * width], detectors))
               for e, name in enumerate(envs)]
    out = _apply("episodes", pos["have"], f, per_env, detectors)
    derive_hack_ratios(out)
    return out
