"""OpenTelemetry export (extra ``otel``): the same families through a MeterProvider.

Gauges become observable gauges and counters observable counters (named without ``_total``;
OpenTelemetry's Prometheus translation appends it again), all carrying a ``run`` attribute.
OpenTelemetry has no way to record a pre-aggregated histogram, and recording the lag of every
token one by one is exactly what rlwatch avoids, so the version-lag histogram is exported as the
cumulative counter ``rlwatch_token_version_lag_tokens{le=...}`` (tokens with lag <= le), which
carries the same information as Prometheus' ``_bucket`` series; the episode-duration histogram likewise
as ``rlwatch_episode_duration_seconds_episodes{env, le}``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

from ..core.metrics import CATALOGUE, HISTOGRAM_BUCKETS, MetricSpec
from ..core.state import MetricState, Snapshot


class OTelExporter:
    """Registers one observable instrument per catalogue family on ``provider``'s meter."""

    def __init__(self, state: MetricState, provider: Any = True, refresh: Callable[[], None] | None = None,
                 snapshot_ttl: float = 0.5) -> None:
        from opentelemetry import metrics as otel_metrics
        from opentelemetry.metrics import Observation

        from .._version import __version__

        if provider is True or provider is None:
            provider = otel_metrics.get_meter_provider()
        self.provider = provider
        self._state = state
        self._refresh = refresh
        self._ttl = snapshot_ttl
        self._cached: tuple[float, Snapshot] | None = None
        self._lock = threading.Lock()
        self._Observation = Observation
        meter = provider.get_meter("rlwatch", __version__)
        self.instruments = []
        for spec in CATALOGUE:
            if spec.kind == "gauge":
                self.instruments.append(meter.create_observable_gauge(
                    spec.full_name, callbacks=[self._family_callback(spec, "gauges")], unit=spec.unit,
                    description=spec.help))
            elif spec.kind == "info":
                self.instruments.append(meter.create_observable_gauge(
                    spec.full_name, callbacks=[self._family_callback(spec, "info", constant=1)], description=spec.help))
            elif spec.kind == "counter":
                self.instruments.append(meter.create_observable_counter(
                    spec.full_name[: -len("_total")], callbacks=[self._family_callback(spec, "counters")],
                    unit=spec.unit, description=spec.help))
            elif spec.kind == "histogram":
                unit = "tokens" if spec.name == "token_version_lag" else "episodes"
                self.instruments.append(meter.create_observable_counter(
                    f"{spec.full_name}_{unit}", callbacks=[self._histogram_callback(spec)],
                    description=spec.help + f" Cumulative {unit} counts by upper bound le."))

    def _snapshot(self) -> Snapshot:
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] > self._ttl:
                if self._refresh is not None:
                    self._refresh()
                self._cached = (now, self._state.snapshot())
            return self._cached[1]

    def _attributes(self, spec: MetricSpec, run: str, labels: tuple[str, ...], instance: str = "") -> dict[str, str]:
        return {"run": run, **({"run_instance": instance} if instance else {}), **dict(zip(spec.labels, labels))}

    def _family_callback(self, spec: MetricSpec, section: str, constant: int | None = None) -> Callable:
        """Observations of ``spec``'s family in one section of the snapshot (``gauges``, ``counters``,
        ``info``), each series with its value, or ``constant`` (info series are 1)."""
        def callback(options: Any) -> Iterable:
            snap = self._snapshot()
            for labels, value in getattr(snap, section).get(spec.name, {}).items():
                yield self._Observation(value if constant is None else constant,
                                        self._attributes(spec, snap.run, labels, snap.run_instance))
        return callback

    def _histogram_callback(self, spec: MetricSpec) -> Callable:
        def callback(options: Any) -> Iterable:
            snap = self._snapshot()
            for labels, (counts, _) in (snap.histograms.get(spec.name) or {}).items():
                running = 0.0
                for bound, count in zip(HISTOGRAM_BUCKETS[spec.name][1], counts):
                    running += count
                    yield self._Observation(running, {**self._attributes(spec, snap.run, labels, snap.run_instance),
                                                      "le": bound})
        return callback

    def close(self) -> None:
        """Nothing to flush here: the provider and its readers belong to the caller (flushing a
        provider whose receiver hangs would block the trainer's shutdown for the export timeout)."""
