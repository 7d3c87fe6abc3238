"""Step-window statistics of the alert catalogue, computed once per step in the training process.

:class:`AlertWindows` is a ``Watch`` step listener. Each step it reads the catalogue's conditions
over the last steps (baselines, pooled rates and their Wilson bounds, standard errors), keeps each
alert's streak (consecutive steps its raise condition held) and, for an open alert, the steps since
its hold condition last held, and returns them as exported values:

- ``alert_value{alert, signal, env, detector, kind}``: the alert's statistic at this step (the last
  known one while an open alert's signal is missing);
- ``alert_streak_steps{...}``: consecutive steps the raise condition held (absent when 0);
- ``alert_hit_steps{...}``: for an intermittent alert, steps among the last ``intermittent_steps``
  on which the raise condition held (absent when 0); it opens the alert at ``intermittent_hits``
  as a streak of ``for_steps`` does;
- ``alert_quiet_steps{...}``: for an open alert, steps since its hold condition last held (0 while
  it holds); the alert fires while this is below ``clear_steps``, and the series goes away the step
  after it reaches ``clear_steps``;
- ``window_baseline{signal}`` / ``window_stderr{signal}``: the baselines and standard errors the
  conditions used;
- ``alert_incident{..., incident, state}``: each time an alert opens is an incident (``incident`` its
  ordinal per alert and label set in this process); its series has ``state="open"`` and the
  statistic's value while open, then ``state="resolved"`` and the value it opened with, kept for
  :data:`DELIVERY_SECONDS` after it resolved. The rules page on these series, so an incident
  reaches Prometheus once whatever the scrape interval, even when it opened and resolved between
  two scrapes.

The incidents and the embedded evaluator's events come from the same transitions (``alert_quiet_steps``
below ``clear_steps`` = open): one computation, one verdict, whatever the time between steps or scrapes.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping

from .catalogue import ALERT_LABELS, ALERTS, Alert, History, evaluate, thresholds

#: Steps of history kept (the longest window reads 120 steps before the latest).
HISTORY_STEPS = 130
#: The families each step exports, by alert and the alert's labels (:data:`ALERT_LABELS`).
EXPORTED = ("alert_value", "alert_streak_steps", "alert_hit_steps", "alert_quiet_steps")
#: Seconds a resolved incident stays exported: longer than any scrape interval (Prometheus' lookback
#: is 5 min), so that a scrape sees an incident that opened and resolved between two scrapes.
DELIVERY_SECONDS = 600.0
#: Resolved incidents kept per alert and label set (a fault that flaps faster than the scrapes).
DELIVERY_KEPT = 16


@dataclass
class _Incident:
    labels: tuple[str, ...]         # the family key and the incident's ordinal
    opened_value: float
    resolved_at: float | None = None


@dataclass
class _State:
    streak: int = 0
    open: bool = False
    quiet: int = 0
    value: float | None = None
    recent: deque = field(default_factory=deque)     # raise verdicts of the last intermittent_steps steps
    incident: _Incident | None = None


def family_key(alert: Alert, key: tuple[str, ...]) -> tuple[str, ...]:
    """The exported label values (:data:`ALERT_LABELS`) of one of ``alert``'s verdict keys."""
    named = dict(zip(alert.step_labels, key))
    return (alert.name,) + tuple(named.get(label, "") for label in ALERT_LABELS[1:])


class AlertWindows:
    """Computes the catalogue's step windows and exports them (a ``Watch`` listener).

    overrides: the run's thresholds ({param: value}); static: values every step carries implicitly
    (the run's settings such as ``staleness_bound``), as Prometheus sees them next to each step.
    """

    def __init__(self, overrides: Mapping[str, float] = (), static: Mapping[str, dict] | None = None,
                 alerts: Iterable[Alert] = ALERTS, clock: Callable[[], float] = time.time) -> None:
        self.params = thresholds(overrides)
        self.static = dict(static or {})
        self.alerts = [a for a in alerts if a.condition is not None]
        self._steps: deque = deque(maxlen=HISTORY_STEPS)
        self._state: dict[tuple[str, tuple[str, ...]], _State] = {}
        self.clock = clock
        self._opened: dict[tuple[str, ...], int] = {}             # incidents so far per family key
        self._resolved: dict[tuple[str, ...], deque[_Incident]] = {}
        self._memory: dict = {}                                   # the conditions' run-long state
        self._before: tuple | None = None                         # (step, state before it): rollback()

    @property
    def clear_steps(self) -> float:
        return self.params["clear_steps"]

    def rollback(self, step: int) -> bool:
        """Undo the latest step when it is ``step``: its history entry, every alert's state and the
        incidents it opened or resolved, so that the same step can be judged again on more values (the
        trainer's logged scalars joined to an observed step): one verdict per step. False when the latest
        step is another one (nothing undone)."""
        if self._before is None or self._before[0] != step or not self._steps or self._steps[-1][0] != step:
            return False
        self._steps.pop()
        self._state, self._opened, self._resolved, self._memory = self._before[1]
        self._before = None
        return True

    def _snapshot(self) -> tuple:
        """What :meth:`rollback` restores: each alert's state (an open incident is shared: only its
        resolution time changes, and a step judged again sets it again), the incident counts, the
        resolved incidents kept, the conditions' memory."""
        state = {key: replace(s, recent=deque(s.recent)) for key, s in self._state.items()}
        resolved = {key: deque(kept, maxlen=kept.maxlen) for key, kept in self._resolved.items()}
        return state, dict(self._opened), resolved, copy.deepcopy(self._memory)

    def on_step(self, step: int, values: Mapping) -> dict:
        self._before = (step, self._snapshot())
        self._steps.append((step, {**self.static, **values} if self.static else dict(values)))
        history = History(list(self._steps), self.params, self._memory)
        out: dict[str, dict] = {name: {} for name in EXPORTED}
        for alert in self.alerts:
            verdicts = evaluate(alert, history)
            keys = set(verdicts) | {k for (name, k) in self._state if name == alert.name}
            for key in keys:
                value, raise_, hold = verdicts.get(key, (None, False, False))
                state = self._state.setdefault((alert.name, key), _State())
                labels = family_key(alert, key)
                if self._advance(alert, state, raise_, hold):
                    state.incident = self._open(labels, value if value is not None else state.value or 0.0)
                if value is not None:
                    state.value = value
                if state.value is not None and (value is not None or state.open):
                    out["alert_value"][labels] = float(state.value)
                if state.streak:
                    out["alert_streak_steps"][labels] = float(state.streak)
                if any(state.recent):
                    out["alert_hit_steps"][labels] = float(sum(state.recent))
                if state.open:
                    out["alert_quiet_steps"][labels] = float(state.quiet)
                    if state.quiet >= self.clear_steps:
                        state.open = False
                        self._resolve(state.incident)
                if not state.open and not state.streak and not any(state.recent) and value is None:
                    del self._state[(alert.name, key)]
        out["alert_incident"] = self._incidents()
        for (kind, signal), v in history.stats.items():
            out.setdefault(f"window_{kind}", {})[(signal,)] = float(v)
        return out

    def _advance(self, alert: Alert, state: _State, raise_: bool, hold: bool) -> bool:
        """One step of an alert's state: its streak, its recent raise steps, opening, quiet steps;
        True when the alert opens at this step."""
        state.streak = state.streak + 1 if raise_ else 0
        hits = 0
        if alert.intermittent:
            state.recent.append(raise_)
            while len(state.recent) > self.params["intermittent_steps"]:
                state.recent.popleft()
            hits = sum(state.recent)
        if not state.open:
            if state.streak >= alert.for_steps or (alert.intermittent and hits >= self.params["intermittent_hits"]):
                state.open, state.quiet = True, 0
                return True
        else:
            state.quiet = 0 if raise_ or hold else state.quiet + 1
        return False

    def _open(self, labels: tuple[str, ...], value: float) -> _Incident:
        ordinal = self._opened[labels] = self._opened.get(labels, 0) + 1
        return _Incident(labels + (str(ordinal),), float(value))

    def _resolve(self, incident: _Incident) -> None:
        incident.resolved_at = self.clock()
        self._resolved.setdefault(incident.labels[:-1], deque(maxlen=DELIVERY_KEPT)).append(incident)

    def _incidents(self) -> dict[tuple[str, ...], float]:
        """``alert_incident``: the open incidents (current value) and those resolved in the last
        :data:`DELIVERY_SECONDS` (the value they opened with)."""
        out = {state.incident.labels + ("open",): float(state.value)
               for state in self._state.values() if state.open and state.incident is not None}
        oldest = self.clock() - DELIVERY_SECONDS
        for key, kept in list(self._resolved.items()):
            while kept and kept[0].resolved_at < oldest:
                kept.popleft()
            if not kept:
                del self._resolved[key]
            for incident in kept:
                out[incident.labels + ("resolved",)] = incident.opened_value
        return out

    def close(self) -> None:
        pass


def firing_keys(values: Mapping, clear_steps: float) -> dict[tuple[str, ...], float | None]:
    """The alerts a step's exported window values say are firing: {label values: current value}."""
    quiet = values.get("alert_quiet_steps", {})
    current = values.get("alert_value", {})
    return {labels: current.get(labels) for labels, q in quiet.items() if q < clear_steps and labels in current}


__all__ = ["AlertWindows", "DELIVERY_SECONDS", "HISTORY_STEPS", "family_key", "firing_keys"]
