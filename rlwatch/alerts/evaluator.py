"""The embedded alert evaluator: the catalogue's verdicts, inside the training process.

It follows the run step by step (a ``Watch`` listener) and reads the step-window values that
:class:`rlwatch.alerts.windows.AlertWindows` exported for the step (``alert_quiet_steps`` below
``clear_steps`` = firing), the very numbers the Prometheus rules compare, so both fire the same
alerts at the same steps. Without a ``Watch`` (values that carry no window statistics) it runs its
own ``AlertWindows``. Each transition is one event, to the run store, the log, the notifiers and the
subscribers; a resolved event carries the statistic's current value. A watchdog thread raises
RLWatchTrainerStalled when no step arrives for ``stall_seconds``. Optional guard actions
(checkpoint, stop, a callback) run on critical alerts. Subscribers and guards run on rlwatch's
alert-actions thread (:mod:`rlwatch.alerts.actions`), outside every rlwatch lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping

from ..core.errors import HookErrors
from .actions import ActionRunner
from .catalogue import ALERT_LABELS, ALERTS, BY_NAME, Alert, History, stalled, thresholds
from .notify import AlertEvent, Dispatcher, log_event
from .template import CONTEXT_FRAGMENTS, render
from .windows import HISTORY_STEPS, AlertWindows, firing_keys

LabelKey = tuple[tuple[str, str], ...]

#: Alert events an evaluator keeps in memory.
EVENTS_KEPT = 1000


def k3_context(values: Mapping) -> dict[str, float | None]:
    """The values of the descriptions' context fragments (k3's, the policy KL's forecast) in a step's
    exported window values."""
    return {name: values.get(f"window_{family}", {}).get((signal,))
            for name, (_, _, family, signal) in CONTEXT_FRAGMENTS.items()}


class AlertEvaluator:
    """Evaluates the alert catalogue per step.

    overrides: threshold values for this run ({param: value}); ValueError on an invalid one.
    guard: callables ``guard(event)`` run when a critical alert fires, on the alert-actions thread; the
        step that fired waits for them at most 100 ms (:data:`rlwatch.alerts.actions.WAIT_SECONDS`), and
        not at all while an earlier callback still runs.
    static: values every step carries implicitly (the run's settings, e.g. ``staleness_bound``), as
        Prometheus sees them as gauges next to each step's signals.
    runbook_base: where the events' ``runbook_url`` points (``<base>#<alert>``); default
        :func:`~rlwatch.alerts.catalogue.runbook_base`. A Watch passes the runbook its exporter serves.
    """

    def __init__(self, run: str, store: Any = None, notifiers: Iterable = (), overrides: Mapping[str, float] = (),
                 errors: HookErrors | None = None, history: int = HISTORY_STEPS, watchdog_interval: float = 5.0,
                 guard: Iterable[Callable[[AlertEvent], None]] = (), alerts: Iterable[Alert] = ALERTS,
                 clock: Callable[[], float] = time.time, static: Mapping[str, dict] | None = None,
                 runbook_base: str | None = None) -> None:
        self.run = run
        self.runbook_base = runbook_base
        self.store = store
        self.errors = errors or HookErrors()
        self.params = thresholds(overrides)
        alerts = list(alerts)
        self.alerts = [a for a in alerts if a.condition is not None]
        self._names = {a.name for a in self.alerts}
        self.windows = AlertWindows(self.params, static, self.alerts)
        self.guard = list(guard)
        self.subscribers: list[Callable[[AlertEvent], None]] = []
        self.static = dict(static or {})
        self.clock = clock
        self._steps: deque = deque(maxlen=history)
        self._pending: dict[tuple[str, LabelKey], int] = {}
        self._firing: dict[tuple[str, LabelKey], AlertEvent] = {}
        # The latest events in memory (the store keeps all of them): bounded for multi-day runs.
        self.events: deque[AlertEvent] = deque(maxlen=EVENTS_KEPT)
        self._lock = threading.Lock()
        self.actions = ActionRunner(lambda kind, message: self.errors.report("alerts", kind, message,
                                                                              raise_in_strict=False))
        notifiers = list(notifiers)
        self.dispatcher = Dispatcher(notifiers, self._notify_error) if notifiers else None
        self._stop = threading.Event()
        self._watchdog = None
        if watchdog_interval and watchdog_interval > 0:
            self._watchdog = threading.Thread(target=self._watch, args=(watchdog_interval,),
                                              name="rlwatch-watchdog", daemon=True)
            self._watchdog.start()

    def _notify_error(self, kind: str, message: str) -> None:
        self.errors.report("notify", kind, message, raise_in_strict=False)

    # --- per step ---------------------------------------------------------------------------

    def on_step(self, step: int, values: Mapping) -> None:
        mark = self.actions.mark()
        self._on_step(step, values)
        self.actions.wait_own(mark)  # this step's own callbacks, at most WAIT_SECONDS, outside the lock

    def _on_step(self, step: int, values: Mapping) -> None:
        with self._lock:
            self._steps.append((step, values))
            if "alert_quiet_steps" not in values:            # not behind a Watch's AlertWindows
                values = {**values, **self.windows.on_step(step, values)}
            now = {labels: v for labels, v in firing_keys(values, self.params["clear_steps"]).items()
                   if labels[0] in self._names}
            before = {key: event for key, event in self._firing.items() if key[0] in self._names}
            for labels, value in now.items():
                alert = BY_NAME[labels[0]]
                named = {k: v for k, v in zip(ALERT_LABELS[1:], labels[1:]) if v != ""}
                key = (alert.name, tuple(sorted(named.items())))
                if key in before:
                    self._firing[key] = self._with_value(self._firing[key], value, step)
                else:
                    self._emit(alert, "firing", step, named, value, k3_context(values))
            current = values.get("alert_value", {})
            now_keys = {(labels[0], tuple(sorted((k, v) for k, v in zip(ALERT_LABELS[1:], labels[1:]) if v != "")))
                        for labels in now}
            for key, event in before.items():
                if key not in now_keys:
                    labels = (key[0],) + tuple(dict(key[1]).get(name, "") for name in ALERT_LABELS[1:])
                    self._emit(BY_NAME[key[0]], "resolved", step, event.labels, current.get(labels, event.value))

    def _apply(self, alert: Alert, firing: list, step: int | None) -> None:
        """The watchdog's alert (RLWatchTrainerStalled): fires and resolves on wall time."""
        now_true: set[tuple[str, LabelKey]] = set()
        for labels, value in firing:
            labels = {k: v for k, v in labels.items() if v != ""}
            key = (alert.name, tuple(sorted(labels.items())))
            now_true.add(key)
            self._pending[key] = self._pending.get(key, 0) + 1
            if key not in self._firing and self._pending[key] >= alert.for_minutes + 1:
                self._emit(alert, "firing", step, labels, value)
            elif key in self._firing:
                self._firing[key] = self._with_value(self._firing[key], value, step)
        for key in [k for k in self._pending if k[0] == alert.name and k not in now_true]:
            del self._pending[key]
            if key in self._firing:
                previous = self._firing[key]
                self._emit(alert, "resolved", step, previous.labels, None)

    @staticmethod
    def _with_value(event: AlertEvent, value: float, step: int | None) -> AlertEvent:
        return AlertEvent(event.name, event.severity, event.state, event.run, step, event.labels, value,
                          event.summary, event.description, event.runbook_url, event.time, event.value_format)

    def _emit(self, alert: Alert, state: str, step: int | None, labels: dict, value: float | None,
              context: Mapping[str, float | None] | None = None) -> None:
        full = {"run": self.run, **labels}
        event = AlertEvent(name=alert.name, severity=alert.severity, state=state, run=self.run, step=step,
                           labels=dict(labels), value=value, summary=alert.summary,
                           description=render(alert.description, full, value, context),
                           runbook_url=f"{self.runbook_base}#{alert.name.lower()}" if self.runbook_base
                           else alert.runbook_url, time=self.clock(), value_format=alert.value_format)
        key = (alert.name, tuple(sorted(labels.items())))
        if state == "firing":
            self._firing[key] = event
        else:
            self._firing.pop(key, None)
        self.events.append(event)
        log_event(event)
        if self.store is not None:
            self.store.submit_alert(self.run, step, alert.name, alert.severity, state, labels, value,
                                    {"summary": alert.summary, "description": event.description,
                                     "runbook_url": event.runbook_url})
        if self.dispatcher is not None:
            self.dispatcher.submit(event)
        for subscriber in self.subscribers:
            self.actions.submit("subscriber", subscriber, event)
        if state == "firing" and alert.severity == "critical":
            for action in self.guard:
                self.actions.submit("guard", action, event)

    # --- watchdog -------------------------------------------------------------------------------

    def check_stalled(self, now: float | None = None) -> None:
        """Evaluate RLWatchTrainerStalled against the wall clock (the watchdog calls this)."""
        with self._lock:
            history = History(list(self._steps)[-1:], self.params)
            step = history.step
            self._apply(BY_NAME["RLWatchTrainerStalled"], stalled(history, self.clock() if now is None else now),
                        step)

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.check_stalled()
            except Exception as exc:  # noqa: BLE001
                self.errors.report("alerts", "watchdog", str(exc), raise_in_strict=False)

    # --- state -----------------------------------------------------------------------------------

    def firing(self) -> list[AlertEvent]:
        with self._lock:
            return list(self._firing.values())

    def close(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        self.actions.close()
        if self.dispatcher is not None:
            self.dispatcher.close()
