"""The catalogue's thresholds: every parameter an alert reads, its default, and a run's overrides.

Thresholds (:data:`PARAMS`) are defaults; a run overrides any of them with
``Watch(alert_overrides={...})``, which the step windows use and which is exported as
``rlwatch_alert_threshold{param=...}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Param:
    default: float
    doc: str


PARAMS: dict[str, Param] = {
    "kl_k3_max": Param(0.1, "k3 = KL(mu||pi_old) above which a step counts toward a spike. verl's rollout-correction "
                       "guidance treats |KL| > 0.1 as unhealthy; bf16 numeric mismatch alone gives ~1e-3."),
    "kl_jump_factor": Param(5.0, "k3 this many times its trailing baseline mean is a jump (a warning)."),
    "kl_jump_floor": Param(0.01, "No jump while k3 stays below this (a jump from 1e-5 to 1e-4 is noise)."),
    "drift_score_max": Param(8.0, "CUSUM drift score (in robust standard deviations) above which a signal "
                             "is drifting (a warning)."),
    "onpolicy_log_ratio_max": Param(0.02, "|mean signed log-ratio| allowed in the first steps of an on-policy "
                                    "run, beyond evidence_z standard errors; numeric noise is zero-mean, a "
                                    "semantics bug is not."),
    "onpolicy_steps": Param(5.0, "Steps counted as the start of the run for the on-policy check."),
    "staleness_over_bound_max": Param(0.0, "Fraction of tokens allowed above the staleness bound."),
    "lag_critical_factor": Param(2.0, "Maximum lag above this many times the staleness bound is critical."),
    "tis_truncated_max": Param(0.05, "Fraction of tokens a TIS cap truncates (w > C), judged by its lower "
                               "confidence bound."),
    "ess_min": Param(0.3, "Normalised effective sample size below which IS weights are degenerate "
                     "(verl flags ESS < 0.3)."),
    "zero_variance_max": Param(0.5, "Fraction of GRPO groups that are all-pass or all-fail (lower bound over "
                               "the last 5 steps' groups)."),
    "truncated_max": Param(0.2, "Fraction of responses cut by the length limit or a timeout (lower bound over "
                           "the last 5 steps' responses)."),
    "hack_ratio_max": Param(0.1, "Fraction of an environment's episodes a reward-hack detector flags, judged by "
                            "the lower confidence bound over the last 10 steps."),
    "hack_jump_factor": Param(2.0, "To open, the hack rate's lower bound must also exceed this many times the "
                              "environment's own rate before the window."),
    "hack_baseline_steps": Param(5.0, "Steps with judged episodes needed before the window for the hack "
                                 "rate to count as rising."),
    "failure_ratio_max": Param(0.05, "Fraction of an environment's episodes failing for infrastructure reasons "
                               "(lower confidence bound)."),
    "entropy_collapse_ratio": Param(0.2, "Entropy below this fraction of its own maximum over the last 120 "
                                    "steps."),
    "stall_seconds": Param(900.0, "Seconds without a new step before the trainer counts as stalled."),
    "nonfinite_ratio_max": Param(0.001, "Fraction of response tokens with a NaN or infinite log-prob (lower "
                                 "confidence bound)."),
    "baseline_steps": Param(20.0, "Steps a trailing baseline needs before any jump or collapse-relative "
                            "condition can hold."),
    "evidence_z": Param(2.33, "Standard normal quantile of the evidence bars: Wilson lower bounds of rates and "
                        "standard errors of means (2.33: one-sided 99%)."),
    "hold_fraction": Param(0.5, "An open alert holds while its statistic stays beyond this fraction of the "
                           "raise threshold (hysteresis; 0.8 let k3 hovering around the bound re-page on the "
                           "tuning split)."),
    "intermittent_hits": Param(3.0, "An intermittent critical alert also opens when its raise condition held on "
                               "this many of the last `intermittent_steps` steps (a fault on every second or "
                               "third step, e.g. one replica of several)."),
    "intermittent_steps": Param(7.0, "Steps of the window in which `intermittent_hits` raise steps open an "
                                "intermittent critical alert."),
    "clear_steps": Param(15.0, "Steps without the hold condition before an open alert resolves: a fault that "
                         "comes back within them is the same incident (10 left re-pages on the tuning split)."),
}


def threshold(param: str) -> str:
    """PromQL for the per-run value of ``param``: the run's exported override, else the default."""
    return (f'(rlwatch_alert_threshold{{param="{param}"}} or on(run, run_instance) '
            f'(0 * rlwatch_step + {PARAMS[param].default:g}))')


def defaults() -> dict[str, float]:
    return {name: p.default for name, p in PARAMS.items()}


def valid_overrides(overrides: Mapping[str, Any],
                    on_invalid: Callable[[str], None] | None = None) -> dict[str, float]:
    """The run's alert overrides that name a parameter of :data:`PARAMS` with a number ({param:
    value}): the one validation of every reader (the exported thresholds, the step windows, the
    evaluator). Each other entry is ignored and described to ``on_invalid(message)``."""
    clean: dict[str, float] = {}
    for name, value in dict(overrides).items():
        try:
            if name not in PARAMS:
                raise KeyError(name)
            clean[name] = float(value)
        except (KeyError, TypeError, ValueError):
            if on_invalid is not None:
                on_invalid(f"ignored alert override {name!r}={value!r} (known: {', '.join(PARAMS)})")
    return clean


def thresholds(overrides: Mapping[str, Any] = (),
               on_invalid: Callable[[str], None] | None = None) -> dict[str, float]:
    """Every parameter's value for a run ({param: value}): the defaults, then the valid overrides."""
    return {**defaults(), **valid_overrides(overrides, on_invalid)}


__all__ = ["PARAMS", "Param", "defaults", "threshold", "thresholds", "valid_overrides"]
