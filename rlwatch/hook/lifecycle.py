"""Start and stop of everything a ``Watch`` runs besides the step pipeline.

:class:`Services` owns the exporters (the /metrics endpoint, Pushgateway, OpenTelemetry), the run
store, the file_sd registration, the in-process alert evaluator (its notifiers and its stall
watchdog), the alert step windows it reads, and the background step worker (in its
:class:`StepScheduler`, which decides where each observed step runs and refuses steps once the Watch
closes); it exports the run's metadata and settings at start, writes what the user records about the
run (checkpoints, events, framework scalars) to the store, waits for the queued steps in
:meth:`Services.flush`, and :meth:`Services.close` stops them in the reverse order of what depends on
what. :class:`Health` is rlwatch's own health (hook errors, store counters), read into the exported
state when an exporter takes a snapshot, never pushed by the step path.

Every start-up failure is counted through :mod:`rlwatch.core.errors` (``stage="export"``, ``"store"``
or ``"alerts"``) and leaves that part off; the others still start.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import time
from typing import Any, Callable, Mapping

from ..core.queues import OrderedWorker
from ..core.config import WatchConfig
from ..core.errors import HookErrors, describe, guard
from ..core.fields import tensor_bytes
from ..core.record import LabelRegistry, clean_text
from ..core.state import MetricState

logger = logging.getLogger("rlwatch")
#: Seconds ``close()`` waits for one more scrape of an alert incident no scrape has shown: with a scraper
#: measured (two scrapes or more), 1.5 of its intervals + 1 s and at most FINAL_SCRAPE_MAX_S; without one
#: (/metrics fetched once, by a person or a health probe), FINAL_SCRAPE_WAIT_S.
FINAL_SCRAPE_WAIT_S, FINAL_SCRAPE_MAX_S = 2.0, 60.0


class Health:
    """rlwatch's own counters, folded into the state at scrape (or push, or OTel collection) time."""

    def __init__(self, state: MetricState, errors: HookErrors) -> None:
        self.state = state
        self.errors = errors
        self.store: Any = None
        self.server: Any = None

    def fold(self) -> None:
        """Copy the hook-error counts, the server's client errors and the store's counters into the
        exported state."""
        self.state.set_counter("hook_errors_total", {k: float(v) for k, v in self.errors.snapshot().items()})
        server = self.server
        if server is not None and server.client_errors:
            self.state.set_counter("http_client_errors_total",
                                   {(code,): float(n) for code, n in list(server.client_errors.items())})
        store = self.store
        if store is not None:
            self.state.set_counter("store_dropped_steps_total", {(): float(store.dropped)})
            self.state.set_counter("store_step_conflicts_total", {(): float(store.step_conflicts)})
            self.state.set_gauge("store_queue_depth", float(store.queue_depth))


def export_alert_thresholds(state: MetricState, overrides: Mapping[str, float]) -> dict[str, float]:
    """Export every alert threshold in force, so that the Prometheus rules read this run's values
    (``rlwatch_alert_threshold{param}``); returns the run's overrides as numbers."""
    from ..alerts.catalogue import PARAMS, validate_overrides

    clean = validate_overrides(overrides)
    for name, param in PARAMS.items():
        state.set_gauge("alert_threshold", clean.get(name, param.default), (name,))
    return clean


def run_metadata(cfg: WatchConfig, signals: Any, rank: int, world: int) -> dict[str, Any]:
    """What the store's run row and ``rlwatch_run_info`` record: the user's ``metadata``, the framework,
    the versions of rlwatch, torch and Python, the signal settings, rank and world size."""
    import torch

    from .._version import __version__

    metadata = dict(cfg.metadata or {})
    metadata.update(framework=clean_text(cfg.framework), framework_version=clean_text(cfg.framework_version),
                    rlwatch_version=__version__, torch_version=torch.__version__,
                    python_version=platform.python_version(), config=signals.__dict__, rank=rank,
                    world_size=world)
    return metadata


def finite_scalars(mapping: Mapping[str, Any], names: LabelRegistry) -> dict[str, float]:
    """``{cleaned name: float}`` of the finite numbers (and one-element tensors) of ``mapping``; the
    rest, and names past the registry's cap, are left out."""
    clean: dict[str, float] = {}
    for key, value in mapping.items():
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if not math.isfinite(number):
            continue
        name, overflow = names.map(names.clean(key)[0])
        if not overflow:
            clean[name] = number
    return clean


def checkpoint_location(path: Any) -> str:
    """A checkpoint path as stored: absolute when local (the post-mortem finds it from any directory),
    a URL as given; a path that is not UTF-8 keeps its raw bytes visible (b"\\xff" -> "\\\\xff")."""
    location = os.fspath(path)
    location = location if "://" in str(location) else os.path.abspath(location)
    try:
        location = os.fsencode(location).decode("utf-8", "backslashreplace")
    except UnicodeError:            # a surrogate that no file name decodes to
        pass
    return clean_text(location)


def _counted(errors: HookErrors, stage: str, prefix: str = "") -> Callable[[str, BaseException], None]:
    """An ``on_error(kind, exc)`` for rlwatch's own threads: counted and logged, never raised."""
    def on_error(kind: str, exc: BaseException) -> None:
        errors.report(stage, kind, f"{prefix}{describe(exc)}", raise_in_strict=False)
    return on_error


def threshold_gauges(cfg: WatchConfig) -> list[tuple[str, float]]:
    """(config gauge, value) of each signal threshold (its declaration names the gauges: ``rlwatch_is_cap``,
    a band's ``rlwatch_mis_low`` and ``rlwatch_mis_high``)."""
    from ..signals.quantities import SIGNAL_THRESHOLDS

    return [(name, value) for t in SIGNAL_THRESHOLDS for name, value, _ in t.gauges(getattr(cfg, t.name))]


def _static_settings(cfg: WatchConfig) -> dict[str, dict]:
    """The run's settings every step carries for the alert conditions, as Prometheus sees them."""
    return {name: {(): value} for name, value in threshold_gauges(cfg)}


def unique_run_instance(services: "Services") -> None:
    """When a live process registered earlier exports this run with this ``run_instance`` (one
    $RLWATCH_RUN_INSTANCE given to two processes), export ``<run_instance>@<host>-<pid>-<start>``
    instead, warn and count (``stage="export", kind="duplicate_run_instance"``): two processes
    behind one identity would merge in the post-mortem and in every rule that joins on it."""
    from ..runs.procinfo import instance_id

    twins = services.registration.earlier_twins()
    if not twins:
        return
    taken = services.state.run_instance
    unique = services.state.run_instance = f"{taken}@{instance_id()}"
    services.registration.relabel(run_instance=unique)
    services.metadata["run_instance"] = unique
    if services.store is not None:
        services.store.submit_run(services.run, dict(services.metadata))
    services.errors.report("export", "duplicate_run_instance", f"run {services.run!r}: run_instance {taken!r} is "
                           f"already exported by a live process ({os.path.basename(twins[0])}); this process "
                           f"exports run_instance {unique!r} instead (give each process its own "
                           f"RLWATCH_RUN_INSTANCE)", raise_in_strict=False)


class StepScheduler:
    """Where observed steps and deferred jobs run: inline, or in order on rlwatch's background worker
    thread (``background=True``); once :attr:`closing`, observed steps are refused and counted."""

    def __init__(self, errors: HookErrors) -> None:
        self.errors = errors
        self.worker: OrderedWorker | None = None
        self.closing = False              # set when the Watch starts closing

    def start_worker(self, max_bytes: int, initializer: Callable[[], None] | None = None) -> None:
        self.worker = OrderedWorker("rlwatch-steps", lambda exc: self.errors.report(
            "background", type(exc).__name__, describe(exc), exc=exc), initializer=initializer, max_bytes=max_bytes)

    def run_step(self, compute: Callable[[bool], Any], fields: Mapping[str, Any]) -> Any:
        """Run one observed step: ``compute(True)`` inline without a worker, ``compute(False)`` in place
        on the worker's own thread (a deferred job observing), else queued on the worker (None; its
        input tensors, ``fields``, count against the worker's byte bound). Refused once closing."""
        if self.closing:
            return self._refused_after_close()
        worker = self.worker
        if worker is None:
            return compute(True)
        if worker.is_current():
            return compute(False)
        if not worker.submit(lambda: compute(False), tensor_bytes(fields)) and self.closing:
            self._refused_after_close()
        return None

    def defer(self, job: Callable[[], Any]) -> bool:
        """Queue ``job`` on the worker, after the steps queued so far; False when the caller must run
        it now (no worker, called from the worker, or refused while closing)."""
        worker = self.worker
        if worker is not None and not self.closing and not worker.is_current():
            return worker.submit(job) or not self.closing
        return False

    def _refused_after_close(self) -> None:
        self.errors.report("observe", "after_close", "a step observed after close() was not used",
                           raise_in_strict=False)

    def drain(self, timeout: float) -> bool:
        """Wait for the queued steps to be computed; True at once on the worker's own thread (the
        steps before the caller already ran) or without a worker."""
        worker = self.worker
        return worker.drain(timeout) if worker is not None and not worker.is_current() else True

    @property
    def dropped(self) -> int:
        """Observed steps the background worker dropped (it stayed full for its ``max_wait``)."""
        return self.worker.dropped if self.worker is not None else 0

    def close(self) -> None:
        """Compute and export the steps still queued (at most 30 s)."""
        if self.worker is not None and not self.worker.close(timeout=30.0):
            self.errors.report("background", "close", "steps still queued after 30 s were not computed")


def _stack_runbook(registration: Any) -> str | None:
    """The runbook server's URL of the `rlwatch up` stack a Watch registered with, if any."""
    if registration is None:
        return None
    from ..runs.stack import served_runbook

    return served_runbook(os.path.dirname(registration.path))


class Services:
    """The optional parts of one Watch, started from its :class:`~rlwatch.core.config.WatchConfig`."""

    def __init__(self, run: str, state: MetricState, errors: HookErrors) -> None:
        self.run = run
        self.state = state
        self.errors = errors
        self.health = Health(state, errors)
        self.store: Any = None
        self.registry: Any = None
        self.exposition: Any = None
        self.server: Any = None
        self.registration: Any = None
        self.push: Any = None
        self.otel: Any = None
        self.evaluator: Any = None
        self.steps = StepScheduler(errors)             # where steps run: inline or on the background worker
        self.windows: Any = None                       # the alert step windows (a step listener)
        self.alert_overrides: dict[str, float] = {}    # the run's valid overrides (the alert windows read them)
        self.scalar_names = LabelRegistry(256)         # the framework scalars' names (capped)
        self.metadata: dict[str, Any] = {}             # the run's metadata (the store's run row)
        self.store_failed = False                      # a store was asked for and could not be opened
        self.lost_at_flush = 0                         # steps and rows lost before the last flush

    def start(self, cfg: WatchConfig, metadata: dict[str, Any], port_offset: int,
              initializer: Callable[[], None] | None = None) -> None:
        """Export the run's metadata and settings, then start what ``cfg`` asks for, in dependency
        order (the evaluator writes to the store)."""
        from ..alerts.windows import AlertWindows

        self.metadata = metadata
        self.state.set_info("run_info", (metadata["framework"], metadata["framework_version"],
                                         metadata["rlwatch_version"]))
        for name, value in threshold_gauges(cfg):
            self.state.set_gauge(name, value)
        overrides = self.alert_overrides = export_alert_thresholds(self.state, cfg.alert_overrides or {})
        # The alerts' step windows, exported for the Prometheus rules and read by the evaluator.
        self.windows = AlertWindows(overrides, static=_static_settings(cfg))
        self.start_store(cfg.store_file(self.run), metadata)
        self.start_endpoint(cfg, port_offset)
        if cfg.pushgateway:
            self.start_push(cfg.pushgateway, cfg.push_interval)
        if cfg.otel:
            self.start_otel(cfg.otel)
        if cfg.alerts if cfg.alerts is not None else self.store is not None:
            self.start_alerts(cfg, overrides)
        if cfg.background and not cfg.strict:
            self.steps.start_worker(cfg.background_max_bytes, initializer)

    def attach(self, pipeline: Any) -> None:
        """Connect the step pipeline to what :meth:`start` started: the alert step windows listen in
        the ``alerts`` phase (after drift and diagnosis, before the user's listeners), the store and the
        evaluator are its sinks."""
        pipeline.listeners.add(self.windows, "alerts")
        pipeline.windows = self.windows
        pipeline.store = self.store
        pipeline.evaluator = self.evaluator

    def start_store(self, path: str | None, metadata: Mapping[str, Any]) -> None:
        if not path:
            return
        from ..runs.store import RunStore

        self.store = guard(self.errors, "store", "open", lambda: RunStore(path, on_error=_counted(self.errors,
                                                                                                    "store")))
        self.store_failed = self.store is None
        if self.store is not None:
            self.health.store = self.store
            self.store.submit_run(self.run, dict(metadata))

    def start_endpoint(self, cfg: WatchConfig, offset: int) -> None:
        """The registry and its cached exposition always; the HTTP server and the file_sd entry when
        ``cfg.port`` is not None."""
        from prometheus_client import CollectorRegistry

        from ..exporters.http import MetricsServer
        from ..exporters.prometheus import CachedExposition, RLWatchCollector

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RLWatchCollector(self.state, self.health.fold))
        on_exposition_error = _counted(self.errors, "export")
        self.exposition = CachedExposition(self.registry, self.state, self.health.fold,
                                           on_error=lambda exc: on_exposition_error("exposition", exc),
                                           firing=self.firing_alerts)
        if cfg.port is None:
            return
        port = cfg.port + offset if cfg.port else cfg.port
        self.server = guard(self.errors, "export", "port", lambda: MetricsServer(
            self.registry, cfg.addr, port, port_fallback=cfg.port_fallback, certfile=cfg.tls_certfile,
            keyfile=cfg.tls_keyfile, basic_auth=cfg.basic_auth, app=self.exposition,
            on_error=_counted(self.errors, "export")))
        if self.server is None:
            return
        self.health.server = self.server
        logger.info("rlwatch: serving %s (run %r)", self.server.url, self.run)
        from ..runs.discovery import Registration, node_address
        from ..runs.stack import sd_directory

        sd_dir = sd_directory(cfg.discovery_dir())
        if sd_dir:
            self.registration = guard(self.errors, "export", "discovery", lambda: Registration(
                sd_dir, self.run, node_address(cfg.addr), self.server.port,
                {"framework": cfg.framework, "run_instance": self.state.run_instance}))
        if self.registration is not None:
            guard(self.errors, "export", "discovery", lambda: unique_run_instance(self))

    def firing_alerts(self) -> list | None:
        """The in-process evaluator's firing alerts; None when alerts are not evaluated here."""
        return self.evaluator.firing() if self.evaluator is not None else None

    def start_push(self, gateway: str, interval: float) -> None:
        from ..alerts.notify import redact, scrub
        from ..exporters.prometheus import PushLoop

        def on_error(kind: str, exc: BaseException) -> None:   # the URL may carry credentials: never shown
            self.errors.report("export", kind, f"pushgateway {redact(gateway)}: {type(exc).__name__}: "
                               f"{scrub(str(exc), gateway)}", raise_in_strict=False)

        self.push = PushLoop(self.registry, gateway, "rlwatch", self.run, interval, on_error,
                             run_instance=self.state.run_instance)

    def start_otel(self, provider: Any) -> None:
        from ..exporters.otel import OTelExporter

        self.otel = guard(self.errors, "export", "otel", lambda: OTelExporter(self.state, provider,
                                                                              self.health.fold))

    def start_alerts(self, cfg: WatchConfig, overrides: Mapping[str, float]) -> None:
        from ..alerts.catalogue import runbook_base
        from ..alerts.evaluator import AlertEvaluator
        from ..core.config import runbook_url

        # the configured runbook ($RLWATCH_RUNBOOK_URL), else the runbook server of the stack this Watch
        # registered with (it outlives the run), else the one this process serves
        served = _stack_runbook(self.registration) or self.server.runbook_url if self.server is not None else None
        base = runbook_url(None, served) if served is not None else runbook_base()
        self.evaluator = guard(self.errors, "alerts", "init", lambda: AlertEvaluator(
            self.run, store=self.store, notifiers=cfg.notifiers, overrides=overrides, errors=self.errors,
            guard=cfg.guard, static=_static_settings(cfg), runbook_base=base))

    # --- what the user records about the run -------------------------------------------------------

    def log_scalars(self, step: int, mapping: Mapping[str, Any]) -> None:
        """A framework's own scalars: exported as ``rlwatch_framework_metric{name}`` and stored."""
        clean = finite_scalars(mapping, self.scalar_names)
        for name, number in clean.items():
            self.state.set_gauge("framework_metric", number, (name,))
        if self.store is not None:
            self.store.submit_scalars(self.run, int(step), clean)

    def record_checkpoint(self, step: int, path: str, flush_timeout: float) -> None:
        """Store the checkpoint row, then :meth:`flush` (a flush that times out is counted)."""
        if self.store is None:
            return
        guard(self.errors, "store", "checkpoint", lambda: self.store.submit_checkpoint(
            self.run, step, checkpoint_location(path)))
        if not self.flush(timeout=flush_timeout):
            self.errors.report("store", "checkpoint_flush", f"steps before checkpoint {step} were not all "
                               f"stored within {flush_timeout:g} s (still queued, or lost: "
                               f"rlwatch_store_dropped_steps_total)", raise_in_strict=False)

    def note(self, kind: str, detail: str) -> None:
        if self.store is not None:
            guard(self.errors, "store", "event", lambda: self.store.submit_event(self.run, kind, detail))

    def flush(self, timeout: float) -> bool:
        """Wait for the queued steps to be computed (unless called from the worker's own thread, where
        the steps before the caller already ran), then for the store to commit them. False when
        ``timeout`` seconds passed first, when the store asked for could not be opened, or when a
        step or row was lost (dropped, counted) since the previous flush."""
        deadline = time.monotonic() + timeout
        drained = self.steps.drain(timeout)
        stored = self.store.flush(max(0.0, deadline - time.monotonic())) if self.store is not None else True
        lost = self.steps.dropped + (self.store.dropped + self.store.dropped_rows if self.store is not None else 0)
        intact, self.lost_at_flush = lost == self.lost_at_flush, lost
        return drained and stored and intact and not self.store_failed

    def close(self, scrape_wait: float | None = None) -> None:
        """Stop the exporters (a last push), remove the file_sd entry, then flush and close the store.
        An alert incident that opened or resolved since the last scrape is served to one more scrape
        first, so a run that ends right after it still pages: 1.5 measured scrape intervals + 1 s (at most
        :data:`FINAL_SCRAPE_MAX_S`), :data:`FINAL_SCRAPE_WAIT_S` without a measured scraper, or at most
        ``scrape_wait`` seconds when given (:meth:`CachedExposition.await_scrape`)."""
        if self.push is not None:           # the gateway serves the last push after the run: nothing stays open
            self.state.resolve_open_incidents()
        if self.server is not None and self.state.delivery_version > self.exposition.served_version:
            guard(self.errors, "export", "final_scrape", lambda: self.exposition.await_scrape(
                self.state.delivery_version, *((FINAL_SCRAPE_WAIT_S, FINAL_SCRAPE_MAX_S) if scrape_wait is None
                                               else (scrape_wait, scrape_wait))))
        stops = (("push", self.push and self.push.close), ("otel", self.otel and self.otel.close),
                 ("discovery", self.registration and self.registration.remove),
                 ("server", self.server and self.server.close))
        for kind, stop in stops:
            if stop:
                guard(self.errors, "export", kind, stop)
        if self.store is not None:
            self._close_store()

    def _close_store(self) -> None:
        store = self.store
        store.flush(10.0)
        if store.dropped:
            store.submit_event(self.run, "data_loss", f"{store.dropped} store rows dropped during the run")
        if store.step_conflicts:
            store.submit_event(self.run, "step_conflicts", f"{store.step_conflicts} steps of attempt "
                               f"{store.attempt} were observed before; the earlier rows are kept in step_history")
        store.close()

