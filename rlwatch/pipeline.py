"""One step's path, in order: build -> compute -> derive -> evaluate -> sinks.

1. **build**: :class:`~rlwatch.record.RecordBuilder` validates the observed fields into a
   :class:`~rlwatch.record.StepRecord` (a bad field is counted and dropped).
2. **compute**: :func:`~rlwatch.signals.compute_step`, every signal on the tensors' device, one
   host transfer; the pipeline wraps the result in the step's :class:`~rlwatch.values.StepValues`.
3. **derive**: the reward-hack verdicts ready since the last step (merged into the step's own counts,
   then ``env_hack_ratio`` derived again over both), the hook's own timing, the errors only the
   values reveal, then each :class:`StepListener` of ``listeners`` in list order (the TRL
   integration's per-generation listener first when there is one, then drift, diagnosis, the alert
   step windows, then the user's). A listener may edit the values; what it returns is merged into
   them by catalogue kind (:meth:`StepValues.merge`: counters add, other families are replaced).
4. **evaluate**: the in-process alert evaluator, explicitly last, so it sees every derived value.
5. **sinks**: the exported state, the run store (the step row, then the hack examples).

Each stage runs under :func:`rlwatch.errors.guard`: a failure is counted as
``rlwatch_hook_errors_total{stage, kind=<exception type>}`` and the step stops there (a listener's
or a sink's failure only skips that listener or sink). The pipeline runs on the thread that calls
:meth:`StepPipeline.run`: the training thread, or rlwatch's worker with ``background=True``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol

from .errors import HookErrors, guard
from .fields import StepFields
from .record import RecordBuilder, StepRecord
from .signals import SignalConfig, Workspace, compute_step
from .state import MetricState
from .values import StepValues, derive_hack_ratios

__all__ = ["StepListener", "StepPipeline", "StepTiming", "derive_hack_ratios", "report_value_errors",
           "standard_listeners"]


class StepListener(Protocol):
    """Something that follows the run step by step (drift detectors, diagnosis, the alert evaluator).

    ``on_step`` may edit ``values`` and may return extra values to export with the step (merged by
    catalogue kind, :meth:`~rlwatch.values.StepValues.merge`)."""

    def on_step(self, step: int, values: StepValues) -> Mapping[str, Mapping[tuple, float | None]] | None: ...

    def close(self) -> None: ...


@dataclass
class StepTiming:
    """The hook's own cost of one step: ``compute`` seconds on this thread, wall time ``now``."""

    compute: float
    now: float


def standard_listeners(staleness_bound: float, extra: tuple[StepListener, ...] = ()) -> list[StepListener]:
    """Drift, then diagnosis, then the user's ``extra`` listeners (a Watch inserts the alert step
    windows after diagnosis once its services start)."""
    from .diagnosis import Diagnoser
    from .drift import DriftDetector

    return [DriftDetector(), Diagnoser(staleness_bound=staleness_bound), *extra]


class StepPipeline:
    """The stages of one step; a Watch holds one and calls :meth:`run` under its lock."""

    def __init__(self, run: str, signals: SignalConfig, state: MetricState, errors: HookErrors,
                 builder: RecordBuilder, listeners: list[StepListener], hack_detectors: Any = None) -> None:
        self.run_name = run
        self.signals = signals
        self.state = state
        self.errors = errors
        self.builder = builder
        self.workspace = Workspace()
        self.listeners = listeners            # the Watch's list: integrations insert into it
        self.evaluator: StepListener | None = None
        self.store: Any = None
        self.hacks: Any = None                # the HackMonitor, started with the first episodes
        self.hack_detectors = hack_detectors
        self._last_time: float | None = None

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
        self.derive(record.step, values, timing)
        self.evaluate(record.step, values)
        self.sinks(record.step, values, timing)
        return record, values

    def build(self, step: int, fields: StepFields) -> StepRecord | None:
        return guard(self.errors, "validate", None, lambda: self.builder.build(step, fields, self.workspace))

    def compute(self, record: StepRecord, on_training_thread: bool) -> StepValues | None:
        # The intra-op thread count is process-wide: only the training thread may lower it.
        with few_threads_for(record.mask) if on_training_thread else contextlib.nullcontext():
            computed = guard(self.errors, "compute", None, lambda: compute_step(record, self.signals, self.workspace))
        return None if computed is None else StepValues.of(computed)

    def derive(self, step: int, values: StepValues, timing: StepTiming) -> None:
        if self.hacks is not None:
            # The detectors' counts add to the step's own (its ``hacked`` flags), then one ratio over both.
            guard(self.errors, "hacks", None, lambda: values.merge(self.hacks.collect()))
        derive_hack_ratios(values)
        values.set("hook_compute_seconds", timing.compute)
        values.set("hook_compute_seconds_total", timing.compute)
        values.set("last_step_timestamp_seconds", timing.now)
        if self._last_time is not None:
            values.set("step_interval_seconds", timing.now - self._last_time)
        self._last_time = timing.now
        report_value_errors(self.errors, values, self.signals.group_size)
        for listener in list(self.listeners):
            self._listen(listener, step, values)

    def evaluate(self, step: int, values: StepValues) -> None:
        if self.evaluator is not None:
            self._listen(self.evaluator, step, values)

    def _listen(self, listener: StepListener, step: int, values: StepValues) -> None:
        extra = guard(self.errors, "alerts", None, lambda: listener.on_step(step, values))
        if extra:
            values.merge(extra)

    def sinks(self, step: int, values: StepValues, timing: StepTiming) -> None:
        guard(self.errors, "export", None, lambda: self.state.apply(values))
        if self.store is not None:
            guard(self.errors, "store", None, lambda: self.store.submit_step(self.run_name, step, values, timing.now))
        if self.hacks is not None:
            guard(self.errors, "hacks", None, self._store_hack_examples)

    def _store_hack_examples(self) -> None:
        examples = self.hacks.take_examples()
        if examples and self.store is not None:
            self.store.submit_hack_examples(self.run_name, examples)

    def hack_monitor(self) -> Any:
        """The :class:`~rlwatch.hacks.HackMonitor` of ``hack_detectors``, started on first use."""
        if self.hacks is None:
            from .hacks import HackMonitor

            self.hacks = HackMonitor(self.hack_detectors, errors=self.errors)
        return self.hacks

    def close(self) -> None:
        """Close the listeners, the evaluator and the hack monitor (a failure is counted, the rest still close)."""
        for listener in [*self.listeners, *([self.evaluator] if self.evaluator is not None else [])]:
            guard(self.errors, "alerts", "close", listener.close)
        if self.hacks is not None:
            guard(self.errors, "hacks", "close", self.hacks.close)


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


# --- threads ---------------------------------------------------------------------------------------

SMALL_BATCH = 1 << 18      # [B, T] positions below which CPU signals run on one intra-op thread


@contextlib.contextmanager
def few_threads_for(mask: Any) -> Iterator[None]:
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


def one_intra_op_thread_here() -> None:
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


def tensor_bytes(fields: Mapping[str, Any]) -> int:
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
