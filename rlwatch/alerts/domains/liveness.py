"""Liveness, evaluated on wall time: a stalled trainer, a down exporter, hook errors, the watchdog."""

from __future__ import annotations

from ..history import History, LabelSet
from ..model import R1, Alert, Example, Param, Runbook, const, cumulative, threshold_expr


#: The thresholds only this domain's alerts read (the shared ones: rlwatch.alerts.params.COMMON).
PARAMS: dict[str, Param] = {
    "stall_seconds": Param(900.0, "Seconds without a new step before the trainer counts as stalled.", above=0.0),
}


def stalled(h: History, now: float) -> list[tuple[LabelSet, float]]:
    """The watchdog's reading of RLWatchTrainerStalled at wall time ``now`` (seconds since the last step)."""
    last = h.latest("last_step_timestamp_seconds")
    if last is None:
        return []
    idle = now - last
    return [({}, idle)] if idle > h.p("stall_seconds") else []


TRAINER_STALLED = Alert(
    name="RLWatchTrainerStalled", severity="critical", for_minutes=0,
    value_format="no step for {:.0f} s",
    prom_expr=("time() - rlwatch_last_step_timestamp_seconds > on(run, run_instance) group_left() "
               f"({threshold_expr('stall_seconds', PARAMS['stall_seconds'].default)})"),
    params=("stall_seconds",),
    summary="The trainer has not finished a step for too long.",
    description="Run {{ $labels.run }}: no step for {{ $value | humanizeDuration }}.",
    windows="Wall time since the last observed step: Prometheus against time(), the training process in a "
            "watchdog thread every few seconds.",
    embedded_note="evaluated by the watchdog thread, not per step",
    runbook=Runbook(
        meaning="The training loop stopped making progress while the process is alive (the exporter "
                "still answers).",
        causes=["A collective (NCCL) hang, a dead rollout worker the trainer waits on, a full disk.",
                "A straggler episode in a synchronous pipeline that never finishes."],
        look=["GPU utilisation, the trainer's own logs, the rollout engine's running/waiting requests."],
        do=["Dump stacks (py-spy), restart the stuck workers, resume from the last checkpoint."]),
    example=Example(series={f"rlwatch_last_step_timestamp_seconds{{{R1}}}": const(0.0, 17),
                            f"rlwatch_step{{{R1}}}": const(0.0, 17)},
                    fires_at=16, labels={"run": "r1"}, value=960.0),
)


EXPORTER_DOWN = Alert(
    name="RLWatchExporterDown", severity="critical", for_minutes=0, keep_firing_minutes=2,
    value_format="up {:g}",
    prom_expr=('up{job=~"rlwatch.*"} == 0\n'
               'and on(job, instance) max_over_time(up{job=~"rlwatch.*"}[1m]) == 0\n'
               'and on(job, instance) max_over_time(up{job=~"rlwatch.*"}[1h]) == 1'),
    labels=("job", "instance"),
    summary="An rlwatch exporter that was up stopped answering.",
    description="{{ $labels.instance }} (job {{ $labels.job }}) was scraped and is now down; its run's alerts "
                "are inhibited.",
    windows="A target that answered in the last hour and whose every scrape of the last minute failed "
            "(the minute is in the expression, not in `for`, so the alert is not even pending for a "
            "target whose run closed cleanly: it removed its file_sd file, and Prometheus, which drops "
            "the target within seconds, may scrape it once or twice meanwhile). A finished run never "
            "pages and a target that never came up is not an outage of a run. keep_firing_for 2m absorbs "
            "a scrape that succeeds once in between.",
    embedded_note="Prometheus only",
    runbook=Runbook(
        meaning="The training process died, hung hard, or its metrics endpoint is unreachable. Every "
                "alert that depends on this exporter is silenced by the Alertmanager inhibition.",
        causes=["The job crashed or was preempted.", "The port moved (port_fallback) or a firewall."],
        look=["The job scheduler; `rlwatch postmortem` on the run store for the last steps it recorded."],
        do=["Restart from the last healthy checkpoint; fix the scrape target."]),
    example=Example(series={'up{job="rlwatch",instance="127.0.0.1:9400"}': [1.0, 1.0, 0.0, 0.0, 0.0],
                            'up{job="rlwatch",instance="127.0.0.1:9401"}': [0.0, 0.0, 0.0, 0.0, 0.0]},
                    fires_at=3, labels={"job": "rlwatch", "instance": "127.0.0.1:9400"}, value=0.0),
)


HOOK_ERRORS = Alert(
    name="RLWatchHookErrors", severity="warning", for_minutes=9,
    value_format="hook errors {:.3g}/s",
    prom_expr="sum by (run, run_instance, stage, kind) (rate(rlwatch_hook_errors_total[10m])) > 0",
    labels=("run", "stage", "kind"),
    summary="rlwatch is discarding bad input or failing to export.",
    description=("Run {{ $labels.run }}: rlwatch errors in stage {{ $labels.stage }} ({{ $labels.kind }}), "
                 "{{ $value | printf \"%.3g\" }}/s. Training continues; some signals are missing."),
    windows="The hook's own health: errors counted in the last 10 minutes.",
    embedded_note="Prometheus only; the process logs each kind once",
    runbook=Runbook(
        meaning="The hook caught errors and carried on: a field of the step record is malformed, or an "
                "exporter or the store failed.",
        causes=["Shapes or dtypes of the tensors passed to observe changed.", "The store's disk is full.",
                "The Pushgateway or a webhook is down."],
        look=["The training log: rlwatch logs each kind once with the field and what was wrong."],
        do=["Fix the integration or the disk; nothing stops training."]),
    example=Example(series={f'rlwatch_hook_errors_total{{{R1},stage="validate",kind="shape"}}':
                            cumulative(const(1.0, 20))},
                    fires_at=10, labels={"run": "r1", "stage": "validate", "kind": "shape"}, value=1 / 60),
)


WATCHDOG = Alert(
    name="RLWatchWatchdog", severity="none", for_minutes=0,
    value_format="watchdog {:g} (always 1)",
    prom_expr="vector(1)",
    labels=(),
    summary="Always firing: proves the alerting pipeline works end to end.",
    description="This alert always fires. If it stops arriving, Prometheus or Alertmanager is broken.",
    windows="Always firing.",
    embedded_note="Prometheus only",
    runbook=Runbook(
        meaning="A dead man's switch for the alerting pipeline itself.",
        causes=["Its absence means Prometheus, the rules or Alertmanager are down."],
        look=["Prometheus /alerts and Alertmanager status."],
        do=["Route it to a heartbeat receiver that pages when it stops."]),
    example=Example(series={"rlwatch_step{run=\"r1\"}": [0.0, 1.0]}, fires_at=0, labels={}, value=1.0),
)


#: The domain's alerts, in page order.
ALERTS: tuple[Alert, ...] = (TRAINER_STALLED, EXPORTER_DOWN, HOOK_ERRORS, WATCHDOG)


__all__ = ["ALERTS", "PARAMS", "stalled", "TRAINER_STALLED", "EXPORTER_DOWN", "HOOK_ERRORS", "WATCHDOG"]
