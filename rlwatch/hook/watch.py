"""``Watch``: the one object a trainer talks to.

``watch.observe(step, **fields)`` runs one step through :class:`rlwatch.hook.pipeline.StepPipeline`
(validate, compute on the tensors' device with one host transfer, derive, evaluate the alerts,
export and store). The parts that live as long as the Watch (endpoint, store, push, OpenTelemetry,
alert evaluator, background worker) are started and stopped by :class:`rlwatch.hook.lifecycle.Services`.
Every option is a field of :class:`rlwatch.core.config.WatchConfig` (``watch.watch_config``; the signal
settings among them are ``watch.signal_config``, a :class:`rlwatch.signals.SignalConfig`); the
process's rank and run name come from :func:`rlwatch.core.config.placement`. Nothing raises into the trainer
unless ``strict=True`` (the policy: :mod:`rlwatch.core.errors`).

Durability: ``observe`` returns once the step is exported (computed, or queued with
``background=True``); the store writes it a moment later on its own thread, so a process killed
right after ``observe`` may lose the last steps. ``flush()`` returning True is the point to rely
on: every step observed before it is committed to the store, and survives the process being
killed. ``record_checkpoint`` flushes, so the steps that led to a checkpoint are stored with it.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, Mapping

from ..core import config as env
from ..alerts.params import validate_overrides
from ..core.config import DEFAULT_PORT, WatchConfig
from ..core.errors import HookErrors, guard
from ..core.fields import StepFields
from ..core.run_report import report as report_to_run        # under `rlwatch run`: tells it this Watch exists
from .lifecycle import Services, run_metadata
from .pipeline import StepListener, StepListeners, StepPipeline, standard_listeners
from ..core.record import RecordBuilder
from ..core.rollout import PhaseClock
from ..core.state import MetricState
from ..core.threads import one_intra_op_thread_here
from ..core.trainer_keys import recognise
from ..core.values import StepValues

logger = logging.getLogger("rlwatch")

__all__ = ["Watch", "StepListener", "DEFAULT_PORT"]


class Watch:
    __doc__ = """Monitor one RL training run: ``Watch(run=None, **options)``, every option a field of
    :class:`~rlwatch.core.config.WatchConfig` (its docstring, below, documents each; the signal thresholds
    among them come from their declaration). Durability: see the module docstring.

    """ + (WatchConfig.__doc__ or "")

    def __init__(self, run: str | None = None, **options: Any) -> None:
        cfg = WatchConfig(run=run, **options)          # TypeError for an unknown option, ValueError for a bad threshold
        validate_overrides(cfg.alert_overrides or {})       # ValueError before anything starts
        self.watch_config = cfg
        self.errors = HookErrors(strict=cfg.strict)
        self.strict = strict = cfg.strict
        where = env.placement(cfg.run, cfg.all_ranks)          # rank, whether it exports, the run's name
        self.rank, self.active, self.run = where.rank, where.active, where.run
        self.signal_config = cfg.signal_config()
        self.state = MetricState(self.run, env.run_instance())
        self.metadata = {**run_metadata(cfg, self.signal_config, self.rank, where.world),
                         "run_instance": self.state.run_instance}
        self._lock = threading.Lock()
        self._closed = False
        self.background = cfg.background and not strict      # steps computed on rlwatch's thread
        self.phases = PhaseClock()                         # watch.phase(...) seconds until the next step
        self.listeners: StepListeners = standard_listeners(cfg.staleness_bound, cfg.listeners)
        self.pipeline = StepPipeline(self.run, self.signal_config, self.state, self.errors,
                                     RecordBuilder(self.errors, env_cap=cfg.env_cap), self.listeners,
                                     cfg.hack_detectors)
        self.services = Services(self.run, self.state, self.errors)
        if not self.active:
            logger.info("rlwatch: rank %d is not rank 0; this process exports nothing (all_ranks=False)", self.rank)
            return
        self.services.start(cfg, self.metadata, where.port_offset, one_intra_op_thread_here)
        self.services.attach(self.pipeline)
        report_to_run("created", framework=cfg.framework, run=self.run, url=self.url, store=self.store_path)

    # --- read-only views of the parts the services and the pipeline own ----------------------------

    run_instance = property(lambda self: self.state.run_instance)   # see rlwatch.core.config.run_instance
    store = property(lambda self: self.services.store)
    server = property(lambda self: self.services.server)
    push = property(lambda self: self.services.push)
    otel = property(lambda self: self.services.otel)
    registration = property(lambda self: self.services.registration)
    registry = property(lambda self: self.services.registry)
    exposition = property(lambda self: self.services.exposition)
    evaluator = property(lambda self: self.services.evaluator)
    hacks = property(lambda self: self.pipeline.hacks)
    _worker = property(lambda self: self.services.steps.worker)

    # --- the hook ---------------------------------------------------------------------------------

    def observe(self, step: int, **fields: Any) -> StepValues | None:
        """Compute and export one step. Returns the step's values, or None if it could not be used,
        or at once with None when ``background=True`` (the step is computed on rlwatch's thread)."""
        return self.observe_fields(step, StepFields.from_mapping(fields))

    def observe_fields(self, step: int, fields: StepFields) -> StepValues | None:
        """:meth:`observe` with the fields already typed (the integrations' entry point)."""
        if not self.active:
            return None
        fields.phases = self.phases.take(fields.phases)
        steps = self.services.steps         # inline, or queued on rlwatch's thread with background=True
        return steps.run_step(lambda inline: self._observe(step, fields, on_training_thread=inline), fields)

    phase = property(lambda self: self.phases.phase)     # `with watch.phase("sync"):` (rollout.PhaseClock.phase)

    def defer(self, job: Callable[[], Any]) -> None:
        """Run ``job`` after the steps observed so far: on rlwatch's thread with ``background=True``,
        else now. Integrations hand their per-step work here; errors are counted, never raised."""
        if not self.services.steps.defer(job):
            guard(self.errors, "integration", "deferred", job)

    def _observe(self, step: int, fields: StepFields, on_training_thread: bool) -> StepValues | None:
        with self._lock:
            episodes = fields.episodes
            result = self.pipeline.run(step, fields, on_training_thread)
            if result is None:
                return None
            record, values = result
            if episodes is not None:       # after the signals: the detectors run during the trainer's step
                guard(self.errors, "hacks", None, lambda: self.submit_episodes(record.step, episodes, env=record.env))
            return values

    @property
    def hack_detection(self) -> bool:
        """Whether episodes passed to this Watch are judged by reward-hack detectors."""
        return self.active and not self._closed and self.pipeline.hack_detectors is not False

    def submit_episodes(self, step: int, episodes: Any, env: list[str] | None = None) -> None:
        """Hand episodes (``rlwatch.hacks.Episode`` or dicts) to the reward-hack detectors; they run off
        the training thread and their verdicts are exported with the next observed step."""
        if self.hack_detection:
            guard(self.errors, "hacks", "submit", lambda: self.pipeline.hack_monitor().submit(step, episodes, env=env))

    def log_scalars(self, step: int, mapping: Mapping[str, Any]) -> None:
        """Record a framework's own scalar metrics (grad norm, loss, ...) next to rlwatch's. The names the
        frameworks log for the trainer's dynamics (:mod:`rlwatch.core.trainer_keys`) become the step's
        values, joined to what ``observe`` gave for the same step (before or after it), or the step's
        only values when it is not observed: stored, exported and judged by the alerts."""
        if not self.active or self._closed:
            return
        guard(self.errors, "export", "log_scalars", lambda: self.services.log_scalars(step, mapping))
        recognised = guard(self.errors, "export", "log_scalars", lambda: recognise(mapping))
        if recognised and not self.services.steps.closing:
            self.services.steps.run_step(lambda inline: self._judge_trainer(int(step), recognised), {})

    def _judge_trainer(self, step: int, recognised: dict[str, float]) -> None:
        with self._lock:
            if not self._closed:
                guard(self.errors, "alerts", "trainer_scalars", lambda: self.pipeline.run_trainer(step, recognised))

    def on_alert(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(event)`` for every firing and resolved event of the in-process evaluator,
        on rlwatch's alert-actions thread, outside rlwatch's locks: the callback may call any public
        method of the Watch or its evaluator. A callback that raises is counted."""
        if self.evaluator is not None:
            self.evaluator.subscribers.append(callback)

    def record_checkpoint(self, step: int, path: str, flush_timeout: float = 10.0) -> None:
        """Note that checkpoint directory ``path`` holds the weights after ``step``. A local path is
        stored absolute, so that the post-mortem finds it from any directory; a URL is kept as given.
        Then flushes (at most ``flush_timeout`` s): the steps observed so far and the checkpoint row
        are in the store when this returns, even if the process is killed during the save."""
        if self.active:
            self.services.record_checkpoint(step, path, flush_timeout)

    def note(self, kind: str, detail: str) -> None:
        """Record an event about the run (shown by the post-mortem)."""
        if self.active:
            self.services.note(kind, detail)

    # --- lifecycle --------------------------------------------------------------------------------

    url = property(lambda self: self.server.url if self.server is not None else None)
    port = property(lambda self: self.server.port if self.server is not None else None)
    store_path = property(lambda self: self.store.path if self.store is not None else None)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every step observed before the call is computed and committed to the store.

        True: those steps survive the process being killed (the store's WAL is synced); without a
        store (``store=None``), they are computed and exported. False: ``timeout`` seconds passed
        first (say a database locked by another process; the steps are still queued, not lost), or
        the store could not be opened (nothing survives a kill), or a step or store row observed
        since the previous ``flush()`` was lost (dropped and counted: a full queue, a failed write)."""
        return self.services.flush(timeout)

    def close(self, scrape_wait: float | None = None) -> None:
        """Stop the endpoint, push a last time, and flush the store. Idempotent. Steps observed
        by other threads once close() started are refused and counted
        (``rlwatch_hook_errors_total{stage="observe",kind="after_close"}``), never lost silently.
        An incident no scrape has shown keeps /metrics up for one more scrape: 1.5 measured scrape
        intervals + 1 s (at most 60 s), 2 s when /metrics was fetched only once, or ``scrape_wait`` s."""
        if self.services.steps.closing:
            return
        self.services.steps.closing = True  # observe() refuses from here on
        self.services.steps.close()       # the steps still queued are computed and exported first
        with self._lock:                  # an observe() computing on another thread finishes first
            self._closed = True
        self.pipeline.close()             # listeners, evaluator, hack monitor
        self.services.close(scrape_wait)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# help(Watch) and IDEs show every option with its default, from WatchConfig (the one list of options).
Watch.__init__.__signature__ = WatchConfig.signature().replace(  # type: ignore[attr-defined]
    parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                *WatchConfig.signature().parameters.values()])
