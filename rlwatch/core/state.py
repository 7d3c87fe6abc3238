"""The exported state of one run: latest gauges, running counters and histogram buckets.

The thread that computes a step (the training thread, or rlwatch's own with ``Watch(background=True)``)
applies its values in one short critical section; exporters (a
Prometheus scrape, an OpenTelemetry collection, a push) read an immutable snapshot on their own
threads, so a scrape always sees one consistent step and never computes anything.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Mapping

from .metrics import BY_NAME, HISTOGRAM_BUCKETS
from .values import value_of


def _histogram_update(name: str, family: Mapping[LabelValues, float | None],
                      sums: Mapping[LabelValues, float | None]) -> Histogram:
    """One step's histogram values (``{(*labels, bucket): count}`` and ``{labels: sum}``) as
    {labels: (counts in bucket order, sum)}."""
    buckets = HISTOGRAM_BUCKETS[name][0]
    keys = {labels[:-1] for labels in family} | set(sums)
    return {key: ([float(family.get((*key, b)) or 0.0) for b in buckets], float(sums.get(key) or 0.0))
            for key in keys}

LabelValues = tuple[str, ...]
Family = dict[LabelValues, float]
#: One histogram family: its label values (without the bucket) -> (per-bucket counts in bucket order, sum).
Histogram = dict[LabelValues, tuple[list[float], float]]

#: Gauge groups whose values persist until overwritten (settings, framework scalars); every other
#: gauge family is replaced by each step, so a signal that was not computed goes stale at once.
STICKY_GROUPS = frozenset({"config", "sampler", "framework", "hook", "diagnosis"})
#: Families a run must not end before a scrape has seen (:attr:`MetricState.delivery_version`).
DELIVERED = ("alert_incident",)


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of the state. ``gauges``/``counters``: name -> {label values: value};
    ``histograms``: name -> {label values: (per-bucket counts in bucket order, sum)} (the lag histogram
    has no labels: its one key is ``()``); ``step`` is the latest step."""

    run: str
    step: int | None
    gauges: dict[str, Family]
    counters: dict[str, Family]
    histograms: dict[str, Histogram]
    info: dict[str, Family] = field(default_factory=dict)
    run_instance: str = ""


class MetricState:
    """Accumulates step values into gauges, counters and histograms. Thread-safe."""

    def __init__(self, run: str, run_instance: str = "") -> None:
        self.run = run
        self.run_instance = run_instance     # tells apart two processes exporting one run name
        self._lock = threading.Lock()
        self._step: int | None = None
        self._gauges: dict[str, Family] = {}
        self._counters: dict[str, Family] = {}
        self._histograms: dict[str, Histogram] = {}
        self._info: dict[str, Family] = {}
        self.version = 0          # bumped on every change: lets exporters reuse a rendering
        self.delivery_version = 0  # the version at which a DELIVERED family last changed

    def apply(self, values: Mapping[str, Mapping[LabelValues, float | None]]) -> None:
        """Fold one step's values (:class:`~rlwatch.core.values.StepValues` or the same plain shape) in: gauges
        replace, counter and histogram increments add (names as in :mod:`rlwatch.core.metrics`; unknown
        names ignored)."""
        gauges: dict[str, Family] = {}
        increments: list[tuple[str, LabelValues, float]] = []
        hist_updates: dict[str, Histogram] = {}
        info: dict[str, Family] = {}
        for name, family in values.items():
            spec = BY_NAME.get(name)
            if spec is None:
                continue
            if spec.kind == "gauge":
                gauges[name] = {k: v for k, v in family.items() if v is not None}
            elif spec.kind == "counter":
                increments.extend((name, k, v) for k, v in family.items() if v is not None)
            elif spec.kind == "histogram":
                hist_updates[name] = _histogram_update(name, family, values.get(name + "_sum") or {})
            elif spec.kind == "info":
                info[name] = {k: 1.0 for k in family}
        with self._lock:
            previous = {name: self._gauges.get(name, {}) for name in DELIVERED}
            step = value_of(values, "step")
            if step is not None:
                self._step = int(step)
            for name in list(self._gauges):
                if name not in gauges and BY_NAME[name].group not in STICKY_GROUPS:
                    del self._gauges[name]
            self._gauges.update(gauges)
            for name, labels, inc in increments:
                fam = self._counters.setdefault(name, {})
                fam[labels] = fam.get(labels, 0.0) + inc
            for name, update in hist_updates.items():
                held = self._histograms.setdefault(name, {})
                for labels, (counts, total) in update.items():
                    old_counts, old_total = held.get(labels, ([0.0] * len(counts), 0.0))
                    held[labels] = ([a + b for a, b in zip(old_counts, counts)], old_total + total)
            self._info.update(info)
            self.version += 1
            if any(gauges.get(name, {}) != previous.get(name, {}) for name in DELIVERED):
                self.delivery_version = self.version

    def set_gauge(self, name: str, value: float, labels: LabelValues = ()) -> None:
        with self._lock:
            family = self._gauges.setdefault(name, {})
            if family.get(labels) != float(value):
                family[labels] = float(value)
                self.version += 1

    def resolve_open_incidents(self) -> int:
        """Mark every open ``alert_incident`` series resolved (its last label is the state), for a
        final push: a Pushgateway keeps a group's last push after the run ends, where an incident
        left open would page forever. Returns how many were open."""
        with self._lock:
            family = self._gauges.get("alert_incident", {})
            open_ = [labels for labels in family if labels and labels[-1] == "open"]
            for labels in open_:
                family[labels[:-1] + ("resolved",)] = family.pop(labels)
            if open_:
                self.version += 1
                self.delivery_version = self.version
            return len(open_)

    def set_info(self, name: str, labels: LabelValues) -> None:
        with self._lock:
            self._info[name] = {labels: 1.0}
            self.version += 1

    def set_counter(self, name: str, family: Family) -> None:
        """Replace a counter family with totals kept elsewhere (hook errors, store drops)."""
        with self._lock:
            if self._counters.get(name) != family:
                self._counters[name] = dict(family)
                self.version += 1

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(
                run=self.run,
                step=self._step,
                gauges={k: dict(v) for k, v in self._gauges.items()},
                counters={k: dict(v) for k, v in self._counters.items()},
                histograms={k: {labels: (list(c), s) for labels, (c, s) in h.items()}
                            for k, h in self._histograms.items()},
                info={k: dict(v) for k, v in self._info.items()},
                run_instance=self.run_instance,
            )
