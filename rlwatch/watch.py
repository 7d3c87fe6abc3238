"""``Watch``: the one object a trainer talks to.

``watch.observe(step, **fields)`` validates a step record, computes every signal on the tensors'
device with one host transfer, and hands the host values to the exporters, the run store and the
in-process alert evaluator. Nothing raises into the trainer unless ``strict=True``: errors are
counted in ``rlwatch_hook_errors_total{stage,kind}`` and logged once per kind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Protocol

from . import __version__
from ._queues import OrderedWorker
from .errors import HookErrors, RLWatchError
from .record import LabelRegistry, RecordBuilder, clean_text
from .signals import SignalConfig, Values, Workspace, compute_step
from .state import MetricState

logger = logging.getLogger("rlwatch")

DEFAULT_PORT = 9400


class StepListener(Protocol):
    """Something that follows the run step by step (alert evaluator, drift detectors).

    ``on_step`` may return extra values to export with the step (e.g. drift scores)."""

    def on_step(self, step: int, values: Values) -> Values | None: ...

    def close(self) -> None: ...


def default_run_name() -> str:
    return os.environ.get("RLWATCH_RUN") or time.strftime("run-%Y%m%d-%H%M%S")


def _rank() -> tuple[int, int, int]:
    """(global rank, local rank, world size) from the usual launcher variables."""
    def env_int(*names: str, default: int) -> int:
        for name in names:
            value = os.environ.get(name)
            if value not in (None, ""):
                try:
                    return int(value)
                except ValueError:
                    pass
        return default
    rank = env_int("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", default=0)
    local = env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", default=rank)
    world = env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", default=1)
    return rank, local, world


class Watch:
    """Monitor one RL training run.

    Args:
        run: run name, the ``run`` label of every series (default: $RLWATCH_RUN or a timestamp).
        port: /metrics port on ``addr`` (default 9400; 0 = any free port; None = no endpoint).
        addr: bind address, 127.0.0.1 unless you ask otherwise.
        port_fallback: when the port is taken, try the next ones instead of failing.
        store: SQLite run-store path; "auto" (default) = $RLWATCH_DIR (./rlwatch-runs)/<run>.db;
            None disables it.
        staleness_bound, is_cap, mis_band, reward_bounds, group_size: see :class:`SignalConfig`.
        env_cap: distinct environment labels kept per run; the rest become "other".
        strict: raise on any error (tests); default False counts and logs instead.
        pushgateway: URL of a Pushgateway to push to every ``push_interval`` seconds and at close.
        otel: an OpenTelemetry MeterProvider (or True for the global one) to export through.
        alerts: evaluate the alert catalogue in-process (default: whenever a store is written).
        notifiers: alert notifiers (webhook, Slack) for the in-process evaluator.
        alert_overrides: per-run alert thresholds ({param: value}, see rlwatch.alerts.catalogue.PARAMS).
        guard: callables run with the event when a critical alert fires (checkpoint, stop, ...).
        all_ranks: export from every rank (run label "<run>-rank<N>", port + local rank) instead
            of rank 0 only.
        tls_certfile, tls_keyfile, basic_auth: protect /metrics with TLS and/or (user, password).
        sd_dir: register the endpoint in a Prometheus file_sd directory (default $RLWATCH_SD_DIR), so
            Prometheus finds exporters that Ray placed on any node (see rlwatch.discovery).
        hack_detectors: reward-hack detectors (names or rlwatch.hacks.Detector) run on the ``episodes``
            passed to observe, off the training thread; None = every registered detector (the
            built-ins included), False = none.
        framework, framework_version, metadata: recorded in the store and ``rlwatch_run_info``.
        background: compute each observed step on one rlwatch thread, in order, so that
            ``observe`` returns at once (None); for trainers on an accelerator, whose training
            thread would otherwise wait for the device's queue at the step's one transfer. On a CPU
            trainer that keeps every core busy the thread only competes with it (measured slower
            than computing inline, ``bench/bench_trl_overhead.py``). The tensors passed must
            not be modified in place afterwards. ``flush()`` waits for the queued steps; guards
            and ``on_alert`` callbacks then run on that thread, a step or so later. Off in strict mode.
        background_max_bytes: bytes of input tensors the background queue may hold (default 256 MiB;
            a queued step keeps its tensors alive, on an accelerator in device memory): when full,
            ``observe`` waits for rlwatch's thread (at most 5 s, then the step is dropped, counted).

    Durability: ``observe`` returns once the step is exported (computed, or queued with
    ``background=True``); the store writes it a moment later on its own thread, so a process killed
    right after ``observe`` may lose the last steps. ``flush()`` returning True is the point to rely
    on: every step observed before it is committed to the store, and survives the process being
    killed. ``record_checkpoint`` flushes, so the steps that led to a checkpoint are stored with it.
    """

    def __init__(self, run: str | None = None, *, port: int | None = DEFAULT_PORT, addr: str = "127.0.0.1",
                 port_fallback: bool = False, store: str | None = "auto", staleness_bound: float = 4.0,
                 is_cap: float = 2.0, mis_band: tuple[float, float] = (0.5, 5.0), env_cap: int = 64,
                 reward_bounds: tuple[float, float] | None = None, group_size: int | None = None,
                 strict: bool = False, pushgateway: str | None = None, push_interval: float = 10.0,
                 otel: Any = None, alerts: bool | None = None, notifiers: tuple = (),
                 all_ranks: bool = False, tls_certfile: str | None = None, tls_keyfile: str | None = None,
                 basic_auth: tuple[str, str] | None = None, framework: str = "custom",
                 framework_version: str = "", metadata: Mapping[str, Any] | None = None,
                 alert_overrides: Mapping[str, float] | None = None, guard: tuple[Callable, ...] = (),
                 sd_dir: str | None = None, hack_detectors: Any = None,
                 listeners: tuple[StepListener, ...] = (), background: bool = False,
                 background_max_bytes: int = 256 << 20) -> None:
        self.errors = HookErrors(strict=strict)
        self.strict = strict
        rank, local_rank, world = _rank()
        self.rank = rank
        self.active = rank == 0 or all_ranks
        base_run = clean_text(run or default_run_name())     # $RLWATCH_RUN may hold surrogate escapes
        framework, framework_version = clean_text(framework), clean_text(framework_version)
        self.run = f"{base_run}-rank{rank}" if all_ranks and world > 1 else base_run
        self.config = SignalConfig(staleness_bound=staleness_bound, is_cap=is_cap, mis_band=tuple(mis_band),
                                   reward_bounds=reward_bounds, group_size=group_size)
        self.state = MetricState(self.run)
        self._lock = threading.Lock()
        self._workspace = Workspace()
        self._builder = RecordBuilder(self.errors, env_cap=env_cap, group_size=group_size)
        self._scalar_names = LabelRegistry(256)
        self._last_time: float | None = None
        self._compute_total = 0.0
        self._closed = False
        self._closing = False
        self.background = background and not strict
        self._worker: OrderedWorker | None = None
        self.server = None
        self.hacks = None
        self._hack_detectors = hack_detectors
        self.evaluator = None
        self.registration = None
        self.store = None
        self.push = None
        self.otel = None
        from .diagnosis import Diagnoser
        from .drift import DriftDetector

        self.listeners: list[StepListener] = [DriftDetector(), Diagnoser(staleness_bound=staleness_bound),
                                              *listeners]
        self.metadata = dict(metadata or {})
        import platform

        import torch

        self.metadata.update(framework=framework, framework_version=framework_version,
                             rlwatch_version=__version__, torch_version=torch.__version__,
                             python_version=platform.python_version(), config=self.config.__dict__, rank=rank,
                             world_size=world)
        if not self.active:
            logger.info("rlwatch: rank %d is not rank 0; this process exports nothing (all_ranks=False)", rank)
            return
        self.state.set_info("run_info", (framework, framework_version, __version__))
        for name, value in (("staleness_bound", staleness_bound), ("is_cap", is_cap), ("mis_low", mis_band[0]),
                            ("mis_high", mis_band[1])):
            self.state.set_gauge(name, value)
        alert_overrides = self._alert_thresholds(alert_overrides or {})
        from .alerts.windows import AlertWindows

        # The alerts' step windows, exported for the Prometheus rules and read by the evaluator.
        self.listeners.insert(2, AlertWindows(alert_overrides, static={
            "staleness_bound": {(): self.config.staleness_bound}, "is_cap": {(): self.config.is_cap}}))
        self._start_store(store)
        self._start_server(port, addr, port_fallback, tls_certfile, tls_keyfile, basic_auth,
                           local_rank if all_ranks else 0, sd_dir, framework)
        if pushgateway:
            self._start_push(pushgateway, push_interval)
        if otel:
            self._start_otel(otel)
        if alerts is None:
            alerts = self.store is not None
        if alerts:
            self._start_alerts(notifiers, alert_overrides, guard)
        if self.background:
            self._worker = OrderedWorker("rlwatch-steps", lambda exc: self.errors.report(
                "background", type(exc).__name__, f"{type(exc).__name__}: {exc}", exc=exc),
                initializer=_one_intra_op_thread_here, max_bytes=background_max_bytes)

    # --- start-up of the optional parts ---------------------------------------------------------

    def _alert_thresholds(self, overrides: Mapping[str, float]) -> dict[str, float]:
        """Validate the run's alert overrides and export every threshold in force, so that the
        Prometheus rules read this run's values (``rlwatch_alert_threshold{param}``)."""
        from .alerts.catalogue import PARAMS

        clean = {}
        for name, value in overrides.items():
            try:
                if name not in PARAMS:
                    raise KeyError(name)
                clean[name] = float(value)
            except (KeyError, TypeError, ValueError):
                self.errors.report("alerts", "unknown_param", f"ignored alert override {name!r}={value!r} (known: "
                                   f"{', '.join(PARAMS)})", raise_in_strict=False)
        for name, param in PARAMS.items():
            self.state.set_gauge("alert_threshold", clean.get(name, param.default), (name,))
        return clean

    def _guard(self, stage: str, kind: str, func: Callable[[], Any]) -> Any:
        try:
            return func()
        except RLWatchError as exc:
            self.errors.report(stage, kind, str(exc), exc=exc)
        except Exception as exc:  # noqa: BLE001 - never raise into the trainer
            self.errors.report(stage, kind, f"{type(exc).__name__}: {exc}", exc=exc)
        return None

    def _start_store(self, store: str | None) -> None:
        if not store:
            return
        path = os.path.join(os.environ.get("RLWATCH_DIR", "rlwatch-runs"), f"{_safe_filename(self.run)}.db") \
            if store == "auto" else store
        from .store import RunStore

        def on_error(kind: str, exc: BaseException) -> None:
            self.errors.report("store", kind, f"{type(exc).__name__}: {exc}", raise_in_strict=False)

        self.store = self._guard("store", "open", lambda: RunStore(path, on_error=on_error))
        if self.store is not None:
            self.store.submit_run(self.run, self.metadata)

    def _start_server(self, port: int | None, addr: str, fallback: bool, certfile: str | None,
                      keyfile: str | None, basic_auth: tuple[str, str] | None, offset: int,
                      sd_dir: str | None, framework: str) -> None:
        from prometheus_client import CollectorRegistry

        from .exporters.prometheus import CachedExposition, RLWatchCollector

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RLWatchCollector(self.state, self._refresh_health))
        self.exposition = CachedExposition(self.registry, self.state, self._refresh_health, on_error=lambda exc:
                                           self.errors.report("export", "exposition", f"{type(exc).__name__}: "
                                                              f"{exc}", exc=exc, raise_in_strict=False))
        if port is None:
            return
        from .exporters.prometheus import MetricsServer

        actual = port + offset if port else port
        self.server = self._guard("export", "port", lambda: MetricsServer(
            self.registry, addr, actual, port_fallback=fallback, certfile=certfile, keyfile=keyfile,
            basic_auth=basic_auth, app=self.exposition, on_error=lambda kind, exc: self.errors.report(
                "export", kind, f"{type(exc).__name__}: {exc}", raise_in_strict=False)))
        if self.server is not None:
            logger.info("rlwatch: serving %s (run %r)", self.server.url, self.run)
            sd_dir = sd_dir if sd_dir is not None else os.environ.get("RLWATCH_SD_DIR")
            if sd_dir:
                from .discovery import Registration, node_address

                self.registration = self._guard("export", "discovery", lambda: Registration(
                    sd_dir, self.run, node_address(addr), self.server.port, {"framework": framework}))

    def _start_push(self, gateway: str, interval: float) -> None:
        from .exporters.prometheus import PushLoop

        from .alerts.notify import redact, scrub

        def on_error(kind: str, exc: BaseException) -> None:   # the URL may carry credentials: never shown
            self.errors.report("export", kind, f"pushgateway {redact(gateway)}: {type(exc).__name__}: "
                               f"{scrub(str(exc), gateway)}", raise_in_strict=False)

        self.push = PushLoop(self.registry, gateway, "rlwatch", self.run, interval, on_error)

    def _start_otel(self, provider: Any) -> None:
        from .exporters.otel import OTelExporter

        self.otel = self._guard("export", "otel", lambda: OTelExporter(self.state, provider, self._refresh_health))

    def _start_alerts(self, notifiers: tuple, overrides: Mapping[str, float], guard: tuple[Callable, ...]) -> None:
        from .alerts.evaluator import AlertEvaluator

        static = {name: {(): value} for name, value in (("staleness_bound", self.config.staleness_bound),
                                                         ("is_cap", self.config.is_cap))}
        evaluator = self._guard("alerts", "init", lambda: AlertEvaluator(
            self.run, store=self.store, notifiers=notifiers, overrides=overrides, errors=self.errors, guard=guard,
            static=static))
        if evaluator is not None:
            self.evaluator = evaluator
            self.listeners.append(evaluator)

    # --- the hook ---------------------------------------------------------------------------------

    def observe(self, step: int, **fields: Any) -> Values | None:
        """Compute and export one step. Returns the step's values, or None if it could not be used,
        or at once with None when ``background=True`` (the step is computed on rlwatch's thread)."""
        if not self.active:
            return None
        if self._closing:
            self._refused_after_close()
            return None
        if self._worker is not None:
            if self._worker.is_current():             # a deferred job observing: compute in place
                return self._observe(step, fields, on_training_thread=False)
            if not self._worker.submit(lambda: self._observe(step, fields, on_training_thread=False),
                                       _tensor_bytes(fields)) and self._closing:
                self._refused_after_close()
            return None
        return self._observe(step, fields, on_training_thread=True)

    def _refused_after_close(self) -> None:
        self.errors.report("observe", "after_close", "a step observed after close() was not used",
                           raise_in_strict=False)

    def defer(self, job: Callable[[], Any]) -> None:
        """Run ``job`` after the steps observed so far: on rlwatch's thread with ``background=True``,
        else now. Integrations hand their per-step work here; errors are counted, never raised."""
        if self._worker is not None and not self._closing and not self._worker.is_current():
            if self._worker.submit(job) or not self._closing:
                return
        self._guard("integration", "deferred", job)

    def _observe(self, step: int, fields: dict[str, Any], on_training_thread: bool) -> Values | None:
        with self._lock:
            started = time.perf_counter()
            episodes = fields.pop("episodes", None)
            record = self._stage("validate", "exception", lambda: self._builder.build(step, fields,
                                                                                     self._workspace))
            if record is None:
                return None
            # The intra-op thread count is process-wide: only the training thread may lower it.
            with _few_threads_for(record.mask) if on_training_thread else contextlib.nullcontext():
                values = self._stage("compute", "exception", lambda: compute_step(record, self.config,
                                                                                  self._workspace))
            if values is None:
                return None
            elapsed = time.perf_counter() - started
            self._after_compute(record.step, values, elapsed)
            if episodes is not None:       # after the signals: the detectors run during the trainer's step
                self._stage("hacks", "submit", lambda: self._submit_episodes(record, episodes))
            return values

    def _stage(self, stage: str, kind: str, func: Callable[[], Any]) -> Any:
        try:
            return func()
        except RLWatchError:
            if self.strict:
                raise
            return None
        except Exception as exc:  # noqa: BLE001
            self.errors.report(stage, type(exc).__name__, str(exc), exc=exc)
            return None

    def _submit_episodes(self, record: Any, episodes: Any) -> None:
        self.submit_episodes(record.step, episodes, env=record.env)

    @property
    def hack_detection(self) -> bool:
        """Whether episodes passed to this Watch are judged by reward-hack detectors."""
        return self.active and not self._closed and self._hack_detectors is not False

    def submit_episodes(self, step: int, episodes: Any, env: list[str] | None = None) -> None:
        """Hand episodes (``rlwatch.hacks.Episode`` or dicts) to the reward-hack detectors; they run off
        the training thread and their verdicts are exported with the next observed step."""
        if not self.hack_detection:
            return
        try:
            if self.hacks is None:
                from .hacks import HackMonitor

                self.hacks = HackMonitor(self._hack_detectors, errors=self.errors)
            self.hacks.submit(step, episodes, env=env)
        except Exception as exc:  # noqa: BLE001
            self.errors.report("hacks", "submit", f"{type(exc).__name__}: {exc}", exc=exc)

    def _merge_hacks(self, values: Values) -> None:
        verdicts = self.hacks.collect()
        if verdicts:
            for name, family in verdicts.items():
                merged = values.setdefault(name, {})
                for labels, value in family.items():
                    counter = name.endswith("_total")
                    merged[labels] = (merged.get(labels) or 0.0) + value if counter else value
        examples = self.hacks.take_examples()
        if examples and self.store is not None:
            self.store.submit_hack_examples(self.run, examples)

    def _after_compute(self, step: int, values: Values, elapsed: float) -> None:
        now = time.time()
        if self.hacks is not None:
            self._stage("hacks", "collect", lambda: self._merge_hacks(values))
        self._compute_total += elapsed
        values["hook_compute_seconds"] = {(): elapsed}
        values["hook_compute_seconds_total"] = {(): elapsed}
        values["last_step_timestamp_seconds"] = {(): now}
        if self._last_time is not None:
            values["step_interval_seconds"] = {(): now - self._last_time}
        self._last_time = now
        self._check_values(values)
        for listener in list(self.listeners):
            extra = self._stage("alerts", "listener", lambda: listener.on_step(step, values))
            if extra:
                values.update(extra)
        self._stage("export", "state", lambda: self.state.apply(values))
        if self.store is not None:
            self._stage("store", "submit", lambda: self.store.submit_step(self.run, step, values, now))

    def _check_values(self, values: Values) -> None:
        """Errors that only the computed values reveal (one host sync already happened)."""
        negative = values.get("negative_lag_tokens_total", {}).get(())
        if negative:
            self.errors.report("validate", "negative_lag", f"{int(negative)} tokens carry a version newer "
                               "than trainer_version; excluded from the lag signals", field="token_version")
        nonfinite = values.get("nonfinite_tokens", {}).get(())
        if nonfinite:
            self.errors.report("validate", "nonfinite_logp", f"{int(nonfinite)} masked tokens have a NaN or "
                               "infinite log-prob; excluded from the mismatch signals",
                               field="sampler_logp/trainer_logp")
        tokens, sequences = values.get("tokens", {}).get(()), values.get("sequences", {}).get(())
        if tokens == 0 and sequences:
            self.errors.report("validate", "all_masked", f"the mask selects no token in {int(sequences)} "
                               "sequences; only per-episode signals are exported", field="mask")
        size = self.config.group_size
        gmin, gmax = values.get("_group_size_min", {}).get(()), values.get("_group_size_max", {}).get(())
        if size and gmin is not None and (gmin != size or gmax != size):
            self.errors.report("validate", "group_size", f"groups have {gmin:g}..{gmax:g} episodes, expected "
                               f"{size} (num_generations)", field="group_ids")

    def _refresh_health(self) -> None:
        """Fold rlwatch's own error and store counters into the exported state (on scrape)."""
        self.state.set_counter("hook_errors_total", {k: float(v) for k, v in self.errors.snapshot().items()})
        if self.store is not None:
            self.state.set_counter("store_dropped_steps_total", {(): float(self.store.dropped)})
            self.state.set_counter("store_step_conflicts_total", {(): float(self.store.step_conflicts)})
            self.state.set_gauge("store_queue_depth", float(self.store.queue_depth))

    def log_scalars(self, step: int, mapping: Mapping[str, Any]) -> None:
        """Record a framework's own scalar metrics (grad norm, loss, ...) next to rlwatch's."""
        if not self.active or self._closed:
            return
        try:
            clean: dict[str, float] = {}
            for key, value in mapping.items():
                try:
                    number = float(value.item() if hasattr(value, "item") else value)
                except (TypeError, ValueError, RuntimeError):
                    continue
                if not math.isfinite(number):
                    continue
                name, _ = self._scalar_names.clean(key)
                name, overflow = self._scalar_names.map(name)
                if overflow:
                    continue
                clean[name] = number
            for name, number in clean.items():
                self.state.set_gauge("framework_metric", number, (name,))
            if self.store is not None:
                self.store.submit_scalars(self.run, int(step), clean)
        except Exception as exc:  # noqa: BLE001
            self.errors.report("export", "log_scalars", str(exc), exc=exc)

    def on_alert(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(event)`` for every firing and resolved event of the in-process evaluator
        (on the training thread; a live view, a custom notifier)."""
        if self.evaluator is not None:
            self.evaluator.subscribers.append(callback)

    def record_checkpoint(self, step: int, path: str, flush_timeout: float = 10.0) -> None:
        """Note that checkpoint directory ``path`` holds the weights after ``step``. A local path is
        stored absolute, so that the post-mortem finds it from any directory; a URL is kept as given.
        Then flushes (at most ``flush_timeout`` s): the steps observed so far and the checkpoint row
        are in the store when this returns, even if the process is killed during the save."""
        if self.store is not None and self.active:
            def submit() -> None:
                location = os.fspath(path)
                location = location if "://" in str(location) else os.path.abspath(location)
                try:        # a path that is not UTF-8 keeps its raw bytes visible: b"\xff" -> "\\xff"
                    location = os.fsencode(location).decode("utf-8", "backslashreplace")
                except UnicodeError:            # a surrogate that no file name decodes to
                    pass
                self.store.submit_checkpoint(self.run, step, clean_text(location))
            self._guard("store", "checkpoint", submit)
            if not self.flush(timeout=flush_timeout):
                self.errors.report("store", "checkpoint_flush", f"steps before checkpoint {step} were not all "
                                   f"stored within {flush_timeout:g} s (still queued)", raise_in_strict=False)

    def note(self, kind: str, detail: str) -> None:
        """Record an event about the run (shown by the post-mortem)."""
        if self.store is not None and self.active:
            self._guard("store", "event", lambda: self.store.submit_event(self.run, kind, detail))

    # --- lifecycle --------------------------------------------------------------------------------

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    @property
    def port(self) -> int | None:
        return self.server.port if self.server is not None else None

    @property
    def store_path(self) -> str | None:
        return self.store.path if self.store is not None else None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every step observed before the call is computed and committed to the store.

        True: those steps survive the process being killed (the store's WAL is synced). False:
        ``timeout`` seconds passed first (say a database locked by another process); the steps are
        still queued, not lost."""
        deadline = time.monotonic() + timeout
        # From rlwatch's own thread (a deferred job), the steps before it already ran.
        drained = self._worker.drain(timeout) if self._worker is not None and not self._worker.is_current() \
            else True
        if self.store is None:
            return drained
        return self.store.flush(max(0.0, deadline - time.monotonic())) and drained

    def close(self) -> None:
        """Stop the endpoint, push a last time, and flush the store. Idempotent. Steps observed
        by other threads once close() started are refused and counted
        (``rlwatch_hook_errors_total{stage="observe",kind="after_close"}``), never lost silently."""
        if self._closing:
            return
        self._closing = True              # observe() refuses from here on
        if self._worker is not None:     # the steps still queued are computed and exported first
            if not self._worker.close(timeout=30.0):
                self.errors.report("background", "close", "steps still queued after 30 s were not computed")
        with self._lock:                  # an observe() computing on another thread finishes first
            self._closed = True
        for listener in self.listeners:
            self._guard("alerts", "close", listener.close)
        if self.hacks is not None:
            self._guard("hacks", "close", self.hacks.close)
        if self.push is not None:
            self._guard("export", "push", self.push.close)
        if self.otel is not None:
            self._guard("export", "otel", self.otel.close)
        if self.registration is not None:
            self._guard("export", "discovery", self.registration.remove)
        if self.server is not None:
            self._guard("export", "server", self.server.close)
        if self.store is not None:
            self.store.flush(10.0)
            lost = self.store.dropped
            if lost:
                self.store.submit_event(self.run, "data_loss", f"{lost} store rows dropped during the run")
            if self.store.step_conflicts:
                self.store.submit_event(self.run, "step_conflicts", f"{self.store.step_conflicts} steps of attempt "
                                        f"{self.store.attempt} were observed before; the earlier rows are kept "
                                        "in step_history")
            self.store.close()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tensor_bytes(fields: Mapping[str, Any]) -> int:
    """Bytes held by the tensors (and arrays) of an observed step's fields, one level of nesting."""
    total = 0
    for value in fields.values():
        items = value.values() if isinstance(value, Mapping) else (value,)
        for item in items:
            if hasattr(item, "element_size") and hasattr(item, "numel"):
                try:
                    total += item.element_size() * item.numel()
                except Exception:  # noqa: BLE001
                    pass
            elif isinstance(getattr(item, "nbytes", None), int):
                total += item.nbytes
    return total


SMALL_BATCH = 1 << 18      # [B, T] positions below which CPU signals run on one intra-op thread


@contextlib.contextmanager
def _few_threads_for(mask: Any) -> Iterator[None]:
    """Run a small CPU step's signals on one intra-op thread, then restore the trainer's setting.

    A small step's signals are a few hundred tiny reductions; with several intra-op threads each one
    waits for the others to wake, which on a busy host costs milliseconds per reduction. Large
    batches keep every thread, and GPU tensors are unaffected. Only rlwatch's own work runs in
    between, on the training thread, so the trainer's numbers do not change."""
    import torch

    threads = torch.get_num_threads()
    if threads == 1 or mask.device.type != "cpu" or mask.numel() >= SMALL_BATCH:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _one_intra_op_thread_here() -> None:
    """Give the calling (rlwatch) thread one intra-op thread, leaving every other thread as it is.

    With OpenMP, each thread that enters a parallel region gets a team of its own: a background
    thread computing small steps would otherwise keep extra spinning threads competing with the
    trainer's. ``torch.set_num_threads`` sets the calling thread's OpenMP setting and a process-wide
    default that threads created later start from; a throw-away thread puts that default back."""
    import torch

    default = torch.get_num_threads()
    if default == 1:
        return
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="rlwatch-threads")
    restore.start()
    restore.join()


def _safe_filename(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:120] or "run"
