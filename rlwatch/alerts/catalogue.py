"""The alert catalogue: every alert rlwatch ships, in one place, and the paging policy it enforces.

Paging policy (stated in ``alerts/runbook.md``):

- **critical** means a person should act now. Only these are critical: a collapse predictor at a
  magnitude that matters (k3 sustained above an absolute bound, importance weights degenerate, the
  lag far beyond the configured bound), a sampler-semantics fault at the start of an on-policy run,
  a reward-hack rate that is both high and rising with statistical evidence, a stopped trainer and a
  crashed exporter.
- **warning** is everything relative: jumps against a run's own baseline, drifts, rates that are
  high but not yet a reason to stop. A relative condition never pages on its own.
- **Evidence before alarm.** No rising or jump condition without a baseline of ``baseline_steps``
  steps; rates are judged by their Wilson lower confidence bound (3 of 40 flagged is not evidence
  of a rate above 5%); the on-policy check subtracts ``evidence_z`` standard errors of the mean
  log-ratio; magnitudes must hold ``for_steps`` consecutive steps (the critical magnitudes also
  open on ``intermittent_hits`` of the last ``intermittent_steps`` steps).
- **One incident, one page.** An alert opens after ``for_steps`` steps of its raise condition and
  stays open while its (looser) hold condition holds and for ``clear_steps`` steps after it last
  held; a fault that persists keeps its alert firing.

One verdict everywhere: the step-window statistics (baselines, rate bounds, standard errors,
streaks, the steps since an alert's condition last held) are computed once per step in the
training process (:mod:`rlwatch.alerts.windows`) and exported as ``rlwatch_alert_value``,
``rlwatch_alert_streak_steps``, ``rlwatch_alert_hit_steps``, ``rlwatch_alert_quiet_steps``,
``rlwatch_window_baseline`` and ``rlwatch_window_stderr``; the process decides when each alert
opens and resolves and exports every opening as an incident (``rlwatch_alert_incident``). The
Prometheus rules page on the incidents and the embedded evaluator reads the same transitions, so
the two fire the same alerts the same number of times whatever the time between steps or scrapes
(delivery: the runbook's paging policy, :attr:`.model.Alert.expr`). Only the wall-clock alerts
(trainer stalled, exporter down, hook errors, the watchdog) are evaluated on time.

Thresholds (:data:`PARAMS`, :mod:`.params`) are defaults; a run overrides any of them with
``Watch(alert_overrides={...})``.

Layout (as kubernetes-mixin splits its alerts): one module per domain under :mod:`.domains`, which
declares its alerts (``ALERTS``), the thresholds only they read (``PARAMS``) and what each alert
indicates (``Alert(roles=...)``, read by the post-mortem); the shared thresholds (:mod:`.params`), the
step-window view (:mod:`.history`) and shared conditions (:mod:`.conditions`), what an alert is
(:mod:`.model`). This module is the index, collected from the domains (no list of alerts here): the
alerts in the order of the rules and the runbook (the domains' :data:`.domains.ORDER`, each domain's
``ALERTS`` in turn), and the names users import.
"""

from __future__ import annotations

import math

from .conditions import wilson_lower
from . import domains
from .domains.liveness import stalled
from .history import History, LabelSet, Verdicts
from .model import ALERT_LABELS, ROLES, RUNBOOK_BASE, Alert, Example, Runbook, StepExample, runbook_base
from .params import PARAMS, Param, defaults, threshold, thresholds, validate_overrides


def collect() -> tuple[Alert, ...]:
    """Every domain module's ``ALERTS``, in :func:`.domains.modules` order. Raises ValueError on a
    name given twice or a threshold no module declares."""
    alerts: tuple[Alert, ...] = tuple(alert for module in domains.modules() for alert in getattr(module, "ALERTS", ()))
    seen: set[str] = set()
    for alert in alerts:
        if alert.name in seen:
            raise ValueError(f"alert {alert.name} declared twice")
        seen.add(alert.name)
        unknown = [p for p in alert.params if p not in PARAMS]
        if unknown:
            raise ValueError(f"alert {alert.name} reads undeclared threshold(s) {unknown}: declare them in the "
                             f"PARAMS of its domain module")
    return alerts


ALERTS: tuple[Alert, ...] = collect()

BY_NAME: dict[str, Alert] = {a.name: a for a in ALERTS}


def with_role(*roles: str) -> tuple[str, ...]:
    """The names of the alerts that declare one of ``roles`` (:data:`.model.ROLES`), in catalogue order."""
    unknown = [role for role in roles if role not in ROLES]
    if unknown:
        raise ValueError(f"unknown role(s) {unknown} (known: {', '.join(ROLES)})")
    return tuple(a.name for a in ALERTS if set(a.roles) & set(roles))

#: Recording rules for the dashboards' wall-clock rate panels (the alerts read the step windows).
RECORDING_RULES: tuple[tuple[str, str], ...] = (
    ("run:rlwatch_tokens_over_staleness_bound:ratio_rate10m",
     "sum by (run, run_instance) (rate(rlwatch_tokens_over_staleness_bound_total[10m]))\n"
     "/ sum by (run, run_instance) (rate(rlwatch_tokens_total[10m]))"),
    ("run:rlwatch_is_tis_truncated_tokens:ratio_rate10m",
     "sum by (run, run_instance) (rate(rlwatch_is_tis_truncated_tokens_total[10m]))\n"
     "/ sum by (run, run_instance) (rate(rlwatch_mismatch_tokens_total[10m]))"),
    ("run:rlwatch_nonfinite_tokens:ratio_rate10m",
     "sum by (run, run_instance) (rate(rlwatch_nonfinite_tokens_total[10m]))\n"
     "/ sum by (run, run_instance) (rate(rlwatch_tokens_total[10m]))"),
    ("run_env_detector:rlwatch_episodes_hacked:ratio_rate10m",
     "sum by (run, run_instance, env, detector) (rate(rlwatch_episodes_hacked_total[10m]))\n"
     "/ sum by (run, run_instance, env, detector) (rate(rlwatch_episodes_judged_total[10m]))"),
    ("run_env_kind:rlwatch_episodes_failed:ratio_rate10m",
     "sum by (run, run_instance, env, kind) (rate(rlwatch_episodes_failed_total[10m]))\n"
     "/ on(run, run_instance, env) group_left() sum by (run, run_instance, env) (rate(rlwatch_episodes_total[10m]))"),
    ("run_env:rlwatch_episodes_truncated:ratio_rate10m",
     "sum by (run, run_instance, env) (rate(rlwatch_episodes_truncated_total[10m]))\n"
     "/ sum by (run, run_instance, env) (rate(rlwatch_episodes_total[10m]))"),
)


def evaluate(alert: Alert, history: History) -> Verdicts:
    """The alert's reading of the latest step ({label values: (value, raise, hold)}; NaN values dropped)."""
    if alert.condition is None:
        return {}
    return {labels: verdict for labels, verdict in alert.condition(history).items()
            if verdict[0] is not None and not (isinstance(verdict[0], float) and math.isnan(verdict[0]))}


__all__ = ["ALERTS", "ALERT_LABELS", "BY_NAME", "PARAMS", "RECORDING_RULES", "ROLES", "RUNBOOK_BASE", "Alert",
           "Example", "History", "LabelSet", "Param", "Runbook", "StepExample", "Verdicts", "collect", "defaults",
           "evaluate", "runbook_base", "stalled", "threshold", "thresholds", "validate_overrides", "with_role",
           "wilson_lower"]
