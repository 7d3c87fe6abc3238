"""The catalogue's thresholds: every parameter an alert reads, its default, and a run's overrides.

Thresholds (:data:`PARAMS`) are defaults; a run overrides any of them with
``Watch(alert_overrides={...})``, which the step windows use and which is exported as
``rlwatch_alert_threshold{param=...}``; the thresholds that rules compare themselves (``stall_seconds``)
may also be set per run name on the Prometheus side (:func:`threshold`). Each parameter declares the
values it allows; an override outside them is refused with a ValueError when the Watch is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Param:
    """A threshold: its default, its meaning, and the values a run may set: from ``low`` (or
    strictly above ``above``) to ``high``, finite."""

    default: float
    doc: str
    low: float = 0.0
    high: float = math.inf
    above: float | None = None

    @property
    def allowed(self) -> str:
        """The allowed range in interval notation, e.g. ``(0, inf)`` or ``[0, 1]``."""
        left = f"({self.above:g}" if self.above is not None else f"[{self.low:g}"
        return f"{left}, {self.high:g}{')' if math.isinf(self.high) else ']'}"

    def allows(self, value: float) -> bool:
        floor_ok = value > self.above if self.above is not None else value >= self.low
        return math.isfinite(value) and floor_ok and value <= self.high


PARAMS: dict[str, Param] = {
    "kl_k3_max": Param(0.1, "k3 = KL(mu||pi_old) above which a step counts toward a spike. verl's rollout-correction "
                       "guidance treats |KL| > 0.1 as unhealthy; bf16 numeric mismatch alone gives ~1e-3.", above=0.0),
    "kl_jump_factor": Param(5.0, "k3 this many times its trailing baseline mean is a jump (a warning).", low=1.0),
    "kl_jump_floor": Param(0.01, "No jump while k3 stays below this (a jump from 1e-5 to 1e-4 is noise)."),
    "kl_departure_factor": Param(8.0, "k3 (its 5-step median) this many times the run's own baseline (its lowest "
                                 "20-step median) pages (RLWatchKLDeparture): language-model runs sit flat near "
                                 "their numerics floor and pass 10x it 150-500 steps before a collapse.", low=1.0),
    "kl_departure_floor": Param(1.5e-3, "No departure page, and no drift warning, while k3's 5-step median stays "
                                "below this (an fp16 run's 1e-5 -> 1e-4 is 10x but harmless).", above=0.0),
    "kl_drift_factor": Param(5.0, "RLWatchMismatchDrift warns only while k3's 5-step median is this many times "
                             "the run baseline (and above kl_departure_floor): the drift score alone fires on "
                             "noise.", low=1.0),
    "drift_score_max": Param(8.0, "CUSUM drift score (in robust standard deviations) above which a signal "
                             "is drifting (a warning).", above=0.0),
    "onpolicy_log_ratio_max": Param(0.02, "|mean signed log-ratio| allowed in the first steps of an on-policy "
                                    "run, beyond evidence_z standard errors; numeric noise is zero-mean, a "
                                    "semantics bug is not."),
    "onpolicy_steps": Param(5.0, "Steps counted as the start of the run for the on-policy check."),
    "staleness_over_bound_max": Param(0.0, "Fraction of tokens allowed above the staleness bound.", high=1.0),
    "lag_critical_factor": Param(2.0, "Maximum lag above this many times the staleness bound is critical.",
                                 low=1.0),
    "tis_truncated_max": Param(0.05, "Fraction of tokens a TIS cap truncates (w > C), judged by its lower "
                               "confidence bound.", high=1.0),
    "ess_min": Param(0.3, "Normalised effective sample size below which IS weights are degenerate "
                     "(verl flags ESS < 0.3).", high=1.0),
    "zero_variance_max": Param(0.5, "Fraction of GRPO groups that are all-pass or all-fail (lower bound over "
                               "the last 5 steps' groups).", high=1.0),
    "truncated_max": Param(0.2, "Fraction of responses cut by the length limit or a timeout (lower bound over "
                           "the last 5 steps' responses).", high=1.0),
    "hack_ratio_max": Param(0.1, "Fraction of an environment's episodes a reward-hack detector flags, judged by "
                            "the lower confidence bound over the last 10 steps.", high=1.0),
    "hack_jump_factor": Param(2.0, "To open, the hack rate's lower bound must also exceed this many times the "
                              "environment's own rate before the window.", low=1.0),
    "hack_baseline_steps": Param(5.0, "Steps with judged episodes needed before the window for the hack "
                                 "rate to count as rising."),
    "failure_ratio_max": Param(0.05, "Fraction of an environment's episodes failing for infrastructure reasons "
                               "(lower confidence bound).", high=1.0),
    "entropy_collapse_ratio": Param(0.2, "Entropy below this fraction of its own maximum over the last 120 "
                                    "steps.", high=1.0),
    "stall_seconds": Param(900.0, "Seconds without a new step before the trainer counts as stalled.", above=0.0),
    "nonfinite_ratio_max": Param(0.001, "Fraction of response tokens with a NaN or infinite log-prob (lower "
                                 "confidence bound).", high=1.0),
    "length_bias_max": Param(0.07, "How much shorter the trained episodes may be than the launched ones, as 1 - "
                             "the mean trained/launched duration ratio over 10 steps (chosen on the tuning split "
                             "of evaluation.rollout_bias, alerts/length-bias-acceptance.md).", high=1.0),
    "baseline_steps": Param(20.0, "Steps a trailing baseline needs before any jump or collapse-relative "
                            "condition can hold.", low=2.0),
    "evidence_z": Param(2.33, "Standard normal quantile of the evidence bars: Wilson lower bounds of rates and "
                        "standard errors of means (2.33: one-sided 99%)."),
    "hold_fraction": Param(0.5, "An open alert holds while its statistic stays beyond this fraction of the "
                           "raise threshold (hysteresis; 0.8 let k3 hovering around the bound re-page on the "
                           "tuning split).", above=0.0, high=1.0),
    "intermittent_hits": Param(2.0, "An intermittent critical alert also opens when its raise condition held on "
                               "this many of the last `intermittent_steps` steps (a fault on every second or "
                               "third step, e.g. one replica of several).", low=1.0),
    "intermittent_steps": Param(4.0, "Steps of the window in which `intermittent_hits` raise steps open an "
                                "intermittent critical alert (2 of 4: the most sensitive window with no healthy "
                                "page on the matrix's tuning split, alerts/acceptance.md). At most 1000: the "
                                "window is kept per alert and label set.", low=1.0, high=1000.0),
    "clear_steps": Param(15.0, "Steps without the hold condition before an open alert resolves: a fault that "
                         "comes back within them is the same incident (10 left re-pages on the tuning split).",
                         low=1.0),
}


def threshold(param: str) -> str:
    """PromQL for the value of ``param`` per process (run, run_instance): a Prometheus-side override
    of the run (``source="overrides"``, ``alerts/overrides.example.yaml``; it applies to every process
    of that run name), else the value the process exports, else the default. One series per (run,
    run_instance) whatever Prometheus scrapes (``max by``): two targets behind one identity (one
    $RLWATCH_RUN_INSTANCE given to two processes, a target scraped by two jobs) would otherwise make
    the rule's ``on(run, run_instance)`` join fail ("found duplicate series") for every run."""
    series = f'rlwatch_alert_threshold{{param="{param}"'
    return (f'max by(run, run_instance) ('
            f'max by(run) ({series}, source="overrides"}}) * on(run) group_right() (0 * rlwatch_step + 1) '
            f'or on(run, run_instance) {series}, source!="overrides"}} '
            f'or on(run, run_instance) (0 * rlwatch_step + {PARAMS[param].default:g}))')


def defaults() -> dict[str, float]:
    return {name: p.default for name, p in PARAMS.items()}


def validate_overrides(overrides: Mapping[str, Any]) -> dict[str, float]:
    """A run's threshold overrides as numbers ({param: value}), the one check of every reader (the
    Watch when it is built, the step windows, the evaluator, ``render --overrides`` for the
    Prometheus-side file). Raises ValueError naming the parameter and its allowed range for an
    unknown name, a value that is not a number, NaN, an infinity or a value out of range."""
    clean: dict[str, float] = {}
    for name, value in dict(overrides).items():
        param = PARAMS.get(name)
        if param is None:
            raise ValueError(f"unknown alert threshold {name!r} (known: {', '.join(PARAMS)})")
        try:
            if isinstance(value, bool):
                raise TypeError(value)
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not param.allows(number):
            raise ValueError(f"alert threshold {name!r}={value!r} is not allowed: {name} must be a number in "
                             f"{param.allowed}")
        clean[name] = number
    merged = {**defaults(), **clean}
    if merged["intermittent_hits"] > merged["intermittent_steps"]:
        raise ValueError(f"alert threshold 'intermittent_hits'={merged['intermittent_hits']:g} is not allowed: "
                         f"intermittent_hits must be in [1, intermittent_steps={merged['intermittent_steps']:g}]")
    return clean


def thresholds(overrides: Mapping[str, Any] = ()) -> dict[str, float]:
    """Every parameter's value for a run ({param: value}): the defaults, then the overrides
    (validated: ValueError on an invalid one, see :func:`validate_overrides`)."""
    return {**defaults(), **validate_overrides(overrides)}


__all__ = ["PARAMS", "Param", "defaults", "threshold", "thresholds", "validate_overrides"]
