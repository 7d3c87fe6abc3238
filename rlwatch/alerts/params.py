"""The catalogue's thresholds: every parameter an alert reads, its default, and a run's overrides.

A threshold is declared next to the alerts that read it: in the ``PARAMS`` of its domain module
(``rlwatch/alerts/domains/<domain>.py``), or, when alerts of several domains read it (the evidence
bars, the hysteresis, the windows of the paging policy), in :data:`COMMON` here. :data:`PARAMS`
collects them: the domains' in the domains' order, then the shared ones.

Thresholds (:data:`PARAMS`) are defaults; a run overrides any of them with
``Watch(alert_overrides={...})``, which the step windows use and which is exported as
``rlwatch_alert_threshold{param=...}``; the thresholds that rules compare themselves (``stall_seconds``)
may also be set per run name on the Prometheus side (:func:`threshold`). Each parameter declares the
values it allows; an override outside them is refused with a ValueError when the Watch is built.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from . import domains
from .model import Param, threshold_expr

#: The thresholds that alerts of several domains read.
COMMON: dict[str, Param] = {
    "baseline_steps": Param(20.0, "Steps a trailing baseline needs before any jump or collapse-relative "
                            "condition can hold.", low=2.0),
    "evidence_z": Param(2.33, "Standard normal quantile of the evidence bars: Wilson lower bounds of rates and "
                        "standard errors of means (2.33: one-sided 99%)."),
    "hold_fraction": Param(0.5, "An open alert holds while its statistic stays beyond this fraction of the "
                           "raise threshold (hysteresis; at 0.8, k3 hovering around the bound re-paged in the "
                           "acceptance runs, alerts/acceptance.md).", above=0.0, high=1.0),
    "intermittent_hits": Param(2.0, "An intermittent critical alert also opens when its raise condition held on "
                               "this many of the last `intermittent_steps` steps (a fault on every second or "
                               "third step, e.g. one replica of several).", low=1.0),
    "intermittent_steps": Param(4.0, "Steps of the window in which `intermittent_hits` raise steps open an "
                                "intermittent critical alert (2 of 4: the most sensitive window with no healthy "
                                "page in the acceptance runs the thresholds were chosen on, alerts/acceptance.md). "
                                "At most 1000: the "
                                "window is kept per alert and label set.", low=1.0, high=1000.0),
    "clear_steps": Param(15.0, "Steps without the hold condition before an open alert resolves: a fault that "
                         "comes back within them is the same incident (with 10, faults re-paged in the acceptance "
                         "runs, alerts/acceptance.md).",
                         low=1.0),
}


def collect() -> dict[str, Param]:
    """Every domain module's ``PARAMS`` (:func:`.domains.modules` order), then :data:`COMMON`. Raises
    ValueError on a name declared twice."""
    out: dict[str, Param] = {}
    for module in domains.modules() + [None]:
        declared = COMMON if module is None else getattr(module, "PARAMS", {})
        where = "rlwatch.alerts.params.COMMON" if module is None else module.__name__
        for name, param in declared.items():
            if name in out:
                raise ValueError(f"alert threshold {name!r} declared twice (again in {where})")
            out[name] = param
    return out


PARAMS: dict[str, Param] = collect()


def threshold(param: str) -> str:
    """PromQL for the value of ``param`` per process (run, run_instance), its default
    (:func:`.model.threshold_expr`)."""
    return threshold_expr(param, PARAMS[param].default)


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


__all__ = ["COMMON", "PARAMS", "Param", "collect", "defaults", "threshold", "thresholds", "validate_overrides"]
