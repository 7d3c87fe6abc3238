"""The episode-level quantities: the per-episode rows (:data:`EPISODE_ROWS`) of the step's [K, B] matrix
and the families with their host formulas from the rows' sums (:data:`EPISODE_METRICS`); the group rows
are in :mod:`.groups`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ..pending import _div
from .declare import EpisodeRow, Metric

#: The response-length quantiles, each a metric ``response_length_p<100 q>`` (linear interpolation
#: between order statistics, as torch.quantile).
LENGTH_QUANTILES = (0.95, 0.99)
#: The first one's quantile (kept for readers of one quantile).
LENGTH_QUANTILE = LENGTH_QUANTILES[-1]

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


def _std(n: float, s: float, sq: float) -> float | None:
    """Population standard deviation from n, sum x, sum x^2."""
    return math.sqrt(max(sq / n - (s / n) ** 2, 0.0)) if n else None


def _length_quantile(quantile: float):
    """The host formula of one of :data:`LENGTH_QUANTILES`: the quantile from its two order statistics
    in ``f.quantiles`` (two per quantile, in that order), the formula of torch.quantile."""
    at = 2 * LENGTH_QUANTILES.index(quantile)

    def formula(f: SimpleNamespace) -> float | None:
        if not f.episodes:
            return None
        rank = quantile * (f.episodes - 1)
        lo_value, hi_value = f.quantiles[at:at + 2]
        return lo_value + (rank - math.floor(rank)) * (hi_value - lo_value)
    return formula


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
    Metric("nonfinite_rewards", lambda f: f.all_ok - f.ok, "rewards",
           help="Episodes (not failed) whose reward is NaN or infinite in the latest step; excluded from every reward "
                "signal.", section="step"),
    Metric("nonfinite_rewards_total", lambda f: f.all_ok - f.ok, "rewards",
           help="Episodes whose reward was NaN or infinite, excluded from the reward signals.", section="step"),
    Metric("reward_mean", lambda f: _div(f.r, f.ok), "rewards",
           help="Mean episode reward in the latest step, infrastructure failures excluded.", section="step"),
    Metric("reward_std", lambda f: _std(f.ok, f.r, f.rr), "rewards",
           help="Standard deviation of episode rewards in the latest step, failures excluded.", section="step"),
    Metric("groups", lambda f: f.groups, "groups",
           help="GRPO groups (prompts) in the latest step.", section="groups"),
    Metric("groups_total", lambda f: f.groups, "groups",
           help="GRPO groups observed.", section="groups"),
    Metric("zero_variance_groups_ratio", lambda f, k: _div(_constant_kinds(f)[k], f.groups), "groups", "kind",
           help="Fraction of groups whose rewards are all equal, by kind.", section="groups"),
    Metric("zero_variance_groups_total", lambda f, k: _constant_kinds(f)[k], "groups", "kind",
           help="Zero-variance groups observed, by kind.", section="groups"),
    Metric("zero_gradient_episodes_ratio", lambda f: _div(f.zero_var_episodes, f.ok), "groups",
           help="Fraction of episodes in zero-variance groups (no GRPO gradient).", section="groups"),
    Metric("_group_size_min", lambda f: f.episodes + 1 - f.max_size_gap if f.max_size_gap > 0 else None, "groups"),
    Metric("_group_size_max", lambda f: f.max_size, "groups"),
    Metric("response_length_mean", lambda f: _div(f.length, f.episodes), "episodes",
           help="Mean response length (tokens).", section="length"),
    Metric("response_length_max", lambda f: f.max_length, "episodes",
           help="Maximum response length (tokens).", section="length"),
    Metric("response_length_p95", _length_quantile(0.95), "episodes",
           help="95th percentile of response length (tokens).", section="length"),
    Metric("response_length_p99", _length_quantile(0.99), "episodes",
           help="99th percentile of response length (tokens).", section="length"),
    Metric("truncated_ratio", lambda f: _div(f.truncated, f.episodes), "truncated",
           help="Fraction of responses cut by the length limit or a timeout.", section="length"),
    Metric("env_episodes", lambda f: f.episodes, "envs", "env",
           help="Episodes per environment in the latest step.", section="env"),
    Metric("episodes_total", lambda f: f.episodes, "envs", "env",
           help="Episodes observed per environment.", section="env"),
    Metric("env_reward_mean", lambda f: _div(f.r, f.ok), "rewards+envs", "env",
           help="Mean reward per environment in the latest step (failures excluded).", section="env"),
    Metric("env_reward_length_corr", _corr, "rewards+envs", "env",
           help="Correlation of reward with response length within an environment in the latest step (batch-level "
                "reward/length hack signal).", section="env"),
    Metric("env_truncated_ratio", lambda f: _div(f.truncated, f.episodes), "truncated+envs", "env",
           help="Truncated fraction per environment.", section="env"),
    Metric("episodes_truncated_total", lambda f: f.truncated, "truncated+envs", "env",
           help="Truncated episodes per environment.", section="env"),
    Metric("env_zero_variance_groups_ratio", lambda f: _div(f.pairs_zero_var, f.pairs), "groups+envs", "env",
           help="Zero-variance group fraction per environment.", section="env"),
    Metric("episodes_hacked_total", lambda f, d: f.hacked[d], "envs", "detector",
           help="Episodes flagged as reward hacks, per environment and detector.", section="env"),
    Metric("episodes_judged_total", lambda f, d: f.episodes, "envs", "detector",
           help="Episodes a reward-hack detector judged (applicable and sampled), per environment and detector: the "
                "denominator of the hack rate.", section="env"),
)
