"""One step's path, in order: build -> compute -> derive -> evaluate -> sinks.

1. **build**: :class:`~rlwatch.core.record.RecordBuilder` validates the observed fields into a
   :class:`~rlwatch.core.record.StepRecord` (a bad field is counted and dropped).
2. **compute**: :func:`~rlwatch.signals.compute_step`, every signal on the tensors' device, one
   host transfer; the pipeline wraps the result in the step's :class:`~rlwatch.core.values.StepValues`.
3. **derive**: the reward-hack verdicts ready since the last step (merged into the step's own counts,
   then ``env_hack_ratio`` derived again over both), the hook's own timing, the errors only the
   values reveal, then each :class:`StepListener` of ``listeners`` by phase
   (:data:`LISTENER_PHASES`: an integration's own, drift, diagnosis, the alert step windows, then
   the user's). A listener may edit the values; what it returns is merged into them by catalogue
   kind (:meth:`StepValues.merge`: counters add, other families are replaced).
4. **evaluate**: the in-process alert evaluator, explicitly last, so it sees every derived value.
5. **sinks**: the exported state, the run store (the step row, then the hack examples).

Each stage runs under :func:`rlwatch.core.errors.guard`: a failure is counted as
``rlwatch_hook_errors_total{stage, kind=<exception type>}`` and the step stops there (a listener's
or a sink's failure only skips that listener or sink; a listener's stage is its phase, the
evaluator's ``alerts``). The pipeline runs on the thread that calls
:meth:`StepPipeline.run`: the training thread, or rlwatch's worker with ``background=True``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol

from ..signals import SignalConfig, Workspace, compute_step
from ..signals.derived import derive_hack_ratios
from ..signals.inputs import StepRecord
from ..core.config import compile_variable
from ..core.errors import HookErrors, guard
from ..core.fields import StepFields
from ..core.record import RecordBuilder
from ..core.state import MetricState
from ..core.threads import few_threads_for
from ..core.values import StepValues
from .join import StepJoin, gauges_only, judged_afresh

__all__ = ["LISTENER_PHASES", "StepListener", "StepListeners", "StepPipeline", "StepTiming", "derive_hack_ratios",
           "report_value_errors", "standard_listeners"]

#: The phases step listeners run in, in order; each is also the ``stage`` its listeners' errors are
#: counted under: an integration's own listener (TRL's per-generation signals), drift, diagnosis, the
#: alert step windows, then the user's (``Watch(listeners=...)``).
LISTENER_PHASES = ("integration", "drift", "diagnosis", "alerts", "listener")


class StepListener(Protocol):
    """Something that follows the run step by step (drift detectors, diagnosis, the alert evaluator).

    ``on_step`` may edit ``values`` and may return extra values to export with the step (merged by
    catalogue kind, :meth:`~rlwatch.core.values.StepValues.merge`)."""

    def on_step(self, step: int, values: StepValues) -> Mapping[str, Mapping[tuple, float | None]] | None: ...

    def close(self) -> None: ...


@dataclass
class StepTiming:
    """The hook's own cost of one step: ``compute`` seconds on this thread, wall time ``now``."""

    compute: float
    now: float


class StepListeners:
    """A Watch's step listeners by phase (:data:`LISTENER_PHASES`); iterating gives them in the order
    they run: phase by phase, in the order added within one."""

    def __init__(self) -> None:
        self._phases: dict[str, list[StepListener]] = {phase: [] for phase in LISTENER_PHASES}

    def add(self, listener: StepListener, phase: str = "listener") -> None:
        """Run ``listener`` in ``phase``, after the ones already there."""
        if phase not in self._phases:
            raise ValueError(f"unknown listener phase {phase!r}; one of {', '.join(LISTENER_PHASES)}")
        self._phases[phase].append(listener)

    def remove(self, listener: StepListener) -> None:
        """Stop running ``listener`` (nothing when it is not there)."""
        for listeners in self._phases.values():
            if listener in listeners:
                listeners.remove(listener)

    def phased(self) -> list[tuple[str, StepListener]]:
        """(phase, listener) in running order, as a list: a listener may add another while they run."""
        return [(phase, listener) for phase, listeners in self._phases.items() for listener in listeners]

    def __iter__(self) -> Iterator[StepListener]:
        return (listener for _, listener in self.phased())

    def __contains__(self, listener: object) -> bool:
        return any(listener in listeners for listeners in self._phases.values())


def standard_listeners(staleness_bound: float, extra: tuple[StepListener, ...] = ()) -> StepListeners:
    """Drift, diagnosis and the user's ``extra`` listeners, each in its phase (a Watch adds the alert
    step windows once its services start)."""
    from ..analyses.diagnosis import Diagnoser
    from ..analyses.drift import DriftDetector

    listeners = StepListeners()
    listeners.add(DriftDetector(), "drift")
    listeners.add(Diagnoser(staleness_bound=staleness_bound), "diagnosis")
    for listener in extra:
        listeners.add(listener)
    return listeners


class StepPipeline:
    """The stages of one step; a Watch holds one and calls :meth:`run` under its lock."""

    def __init__(self, run: str, signals: SignalConfig, state: MetricState, errors: HookErrors,
                 builder: RecordBuilder, listeners: StepListeners, hack_detectors: Any = None) -> None:
        self.run_name = run
        self.signals = signals
        self.state = state
        self.errors = errors
        self.builder = builder
        self.workspace = Workspace(compile=compile_variable())
        self.listeners = listeners            # the Watch's: integrations add theirs
        self.evaluator: StepListener | None = None
        self.windows: Any = None              # the alert step windows (rolled back when a step is judged again)
        self.join = StepJoin()                # the latest step, to join observe and the trainer's scalars
        self.store: Any = None
        self.hacks: Any = None                # the HackMonitor, started with the first episodes
        self.hack_detectors = hack_detectors
        self._last_time: float | None = None
        self._hack_counts: list[tuple[int, dict]] = []    # (source step, counter increments) for the store

    def run(self, step: int, fields: StepFields, on_training_thread: bool) -> tuple[StepRecord, StepValues] | None:
        """Every stage for one observed step; (record, values), or None when the step was unusable."""
        started = time.perf_counter()
        record = self.build(step, fields)
        if record is None:
            return None
        values = self.compute(record, on_training_thread)
        if values is None:
            return None
        timing = StepTiming(time.perf_counter() - started, time.time())
        trainer = self.join.pending_trainer(record.step)     # the trainer's scalars logged before observe
        if trainer and self.windows is not None:
            self.windows.rollback(record.step)
        observed = frozenset(values)
        for name, value in trainer.items():                   # rlwatch's own value wins
            values.setdefault(name, {(): float(value)})
        self.derive(record.step, values, timing)
        self.evaluate(record.step, values)
        self.sinks(record.step, values, timing, replace=bool(trainer))
        self.join.remember(record.step, values, observed, trainer)
        return record, values

    def run_trainer(self, step: int, trainer: dict[str, float]) -> StepValues | None:
        """Judge ``step`` with the trainer's recognised scalars (``{signal: value}``): joined to the step's
        observed values when that step was the latest judged (judged again, the verdict replaced), else a
        step of its own (the alert windows, the evaluator, the exported state and the store; the drift,
        diagnosis and user listeners read observed steps only)."""
        join = self.join
        if join.step is not None and step < join.step:      # an older step's log: kept as framework scalars
            return None
        if join.step == step and join.values is not None:
            values = judged_afresh(join.values)
            if self.windows is not None:
                self.windows.rollback(step)
            replace = True
        else:
            values = StepValues({"step": {(): float(step)}})
            values.set("last_step_timestamp_seconds", time.time())
            replace = False
        join.remember(step, values, None, trainer)
        join.add_trainer(values, join.trainer)
        if self.windows is not None:
            self._listen("alerts", self.windows, step, values)
        self.evaluate(step, values)
        guard(self.errors, "export", None, lambda: self.state.apply(gauges_only(values) if replace else values))
        if self.store is not None:
            guard(self.errors, "store", None, lambda: self.store.submit_step(self.run_name, step, values,
                                                                             time.time(), replace=replace))
        return values

    def build(self, step: int, fields: StepFields) -> StepRecord | None:
        return guard(self.errors, "validate", None, lambda: self.builder.build(step, fields, self.workspace))

    def compute(self, record: StepRecord, on_training_thread: bool) -> StepValues | None:
        # The intra-op thread count is process-wide: only the training thread may lower it.
        with few_threads_for(record.mask) if on_training_thread else contextlib.nullcontext():
            computed = guard(self.errors, "compute", None, lambda: compute_step(record, self.signals, self.workspace))
        return None if computed is None else StepValues.of(computed)

    def derive(self, step: int, values: StepValues, timing: StepTiming) -> None:
        # The detectors' counts add to the step's own (its ``hacked`` flags), then one ratio over both; the
        # store also keeps both under the step the episodes came from (_store_hack_counts).
        self._hack_counts = [(step, {family: dict(values.get(family) or {}) for family in HACK_COUNTERS})]
        if self.hacks is not None:
            guard(self.errors, "hacks", None, lambda: self._merge_verdicts(values))
        derive_hack_ratios(values)
        values.set("hook_compute_seconds", timing.compute)
        values.set("hook_compute_seconds_total", timing.compute)
        values.set("last_step_timestamp_seconds", timing.now)
        if self._last_time is not None:
            values.set("step_interval_seconds", timing.now - self._last_time)
        self._last_time = timing.now
        report_value_errors(self.errors, values, self.signals.group_size)
        for phase, listener in self.listeners.phased():
            self._listen(phase, listener, step, values)

    def _merge_verdicts(self, values: StepValues) -> None:
        from ..hacks.monitor import sum_counts

        by_step = self.hacks.collect_by_step()
        values.merge(sum_counts(by_step.values()))
        self._hack_counts.extend(sorted((source, counts) for source, counts in by_step.items() if source is not None))

    def evaluate(self, step: int, values: StepValues) -> None:
        if self.evaluator is not None:
            self._listen("alerts", self.evaluator, step, values)

    def _listen(self, stage: str, listener: StepListener, step: int, values: StepValues) -> None:
        extra = guard(self.errors, stage, None, lambda: listener.on_step(step, values))
        if extra:
            values.merge(extra)

    def sinks(self, step: int, values: StepValues, timing: StepTiming, replace: bool = False) -> None:
        guard(self.errors, "export", None, lambda: self.state.apply(values))
        if self.store is not None:
            guard(self.errors, "store", None, lambda: self.store.submit_step(self.run_name, step, values, timing.now,
                                                                             replace=replace))
            guard(self.errors, "store", None, self._store_hack_counts)
        if self.hacks is not None:
            guard(self.errors, "hacks", None, self._store_hack_examples)

    def _store_hack_counts(self) -> None:
        for source, counts in self._hack_counts:
            judged = counts.get("episodes_judged_total") or {}
            if judged:
                self.store.submit_hack_counts(self.run_name, source, judged, counts.get("episodes_hacked_total") or {})
        self._hack_counts = []

    def _store_hack_examples(self) -> None:
        examples = self.hacks.take_examples()
        if examples and self.store is not None:
            self.store.submit_hack_examples(self.run_name, examples)

    def hack_monitor(self) -> Any:
        """The :class:`~rlwatch.hacks.HackMonitor` of ``hack_detectors``, started on first use."""
        if self.hacks is None:
            from ..hacks import HackMonitor

            self.hacks = HackMonitor(self.hack_detectors, errors=self.errors)
        return self.hacks

    def close(self) -> None:
        """Close the listeners, the evaluator and the hack monitor (a failure is counted, the rest still close)."""
        evaluator = [("alerts", self.evaluator)] if self.evaluator is not None else []
        for stage, listener in [*self.listeners.phased(), *evaluator]:
            guard(self.errors, stage, "close", listener.close)
        if self.hacks is not None:
            guard(self.errors, "hacks", "close", self.hacks.close)
            if self.store is not None:      # the verdicts that came after the last step, under their own steps
                guard(self.errors, "store", None, self._store_late_verdicts)

    def _store_late_verdicts(self) -> None:
        self._hack_counts = sorted((s, c) for s, c in self.hacks.collect_by_step().items() if s is not None)
        self._store_hack_counts()
        self._store_hack_examples()


#: The counters of judged and flagged episodes, per (env, detector).
HACK_COUNTERS = ("episodes_judged_total", "episodes_hacked_total")


def report_value_errors(errors: HookErrors, values: StepValues, group_size: int | None) -> None:
    """Errors that only the computed values reveal (one host sync already happened)."""
    scalar = values.value
    negative = scalar("negative_lag_tokens_total")
    if negative:
        errors.report("validate", "negative_lag", f"{int(negative)} tokens carry a version newer than "
                      "trainer_version, or NaN, infinite or negative; excluded from the lag signals",
                      field="token_version")
    nonfinite = scalar("nonfinite_tokens")
    if nonfinite:
        errors.report("validate", "nonfinite_logp", f"{int(nonfinite)} masked tokens have a NaN or infinite "
                      "log-prob; excluded from the mismatch signals", field="sampler_logp/trainer_logp")
    tokens, sequences = scalar("tokens"), scalar("sequences")
    if tokens == 0 and sequences:
        errors.report("validate", "all_masked", f"the mask selects no token in {int(sequences)} sequences; "
                      "only per-episode signals are exported", field="mask")
    gmin, gmax = scalar("_group_size_min"), scalar("_group_size_max")
    if group_size and gmin is not None and (gmin != group_size or gmax != group_size):
        errors.report("validate", "group_size", f"groups have {gmin:g}..{gmax:g} episodes, expected "
                      f"{group_size} (num_generations)", field="group_ids")

