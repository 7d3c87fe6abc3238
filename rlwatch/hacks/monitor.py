"""Run hack detectors off the training thread and feed their verdicts to the step values.

``HackMonitor.submit(step, episodes)`` only enqueues (bounded; a full queue drops the batch and
counts it). A worker runs every applicable detector on every episode (or on a deterministic
sample for expensive ones); a detector that raises, or takes longer than its ``timeout`` on an
episode, is counted as its own error kind and its verdict is unknown, never "not hacked".

The worker is a separate process (``rlwatch.hacks.worker``) when every detector and every
checker named with ``use_checker`` lives in an importable module, as the built-ins do: detectors
are Python code, and in a thread they would compete with the training loop for the GIL. With a
lambda, a closure or a function of the training script itself among them, a thread does the
work instead. A detector that hangs holds up its worker; the queue then fills and later batches
are dropped and counted, the trainer never waits, and ``close()`` waits a bounded time (the
queued batches up to its ``timeout``, then a few seconds for the worker; a child still running is
killed).
``collect_by_step()`` hands the verdicts finished since the last call to the Watch, keyed by the step
their episodes came from (never by the step that collects them, so that a detector slowed by the
machine's load changes when a verdict arrives, not which step it counts for): ``episodes_judged_total``
/ ``episodes_hacked_total`` per environment and detector. The Watch adds them to the next step's
counters (Prometheus sees totals) and stores them under their own step (the run store's
``hack_counts``), from which the post-mortem derives ``env_hack_ratio`` step by step.
A few flagged episodes are kept (text truncated) for the post-mortem.

The batch-level reward/length detector is a per-environment signal computed with the other
signals (``rlwatch_env_reward_length_corr``); the DriftDetector scores its jumps against the
environment's own trailing baseline.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Iterable

from ..core.queues import stop_consumer
from ..core.errors import HookErrors
from ..core.values import Values
from .judge import BatchResult, Example, _clean_keys, judge_batch
from .registry import Detector, resolve

def _importable(functions: Iterable[Any]) -> bool:
    """Whether another interpreter can load these functions by reference (no lambdas, closures, or
    functions of the training script's own ``__main__``)."""
    for fn in functions:
        module = getattr(fn, "__module__", None)
        if module in (None, "__main__", "__mp_main__") or "<" in getattr(fn, "__qualname__", "<"):
            return False
        try:
            pickle.dumps(fn)
        except Exception:  # noqa: BLE001
            return False
    return True


def sum_counts(parts: Iterable[Values]) -> Values | None:
    """Counter increments ({family: {labels: n}}) added family by family (None when there are none)."""
    out: Values = {}
    for part in parts:
        for family, counts in part.items():
            into = out.setdefault(family, {})
            for key, n in counts.items():
                into[key] = into.get(key, 0.0) + n
    return out or None


class HackMonitor:
    """Background hack detection for one run (in a child process when it can, else a thread)."""

    def __init__(self, detectors: Iterable[Detector | str] | None = None, errors: HookErrors | None = None,
                 max_queue: int = 64, max_examples: int = 20, mode: str = "auto") -> None:
        from .builtin import _CHECKERS

        self.detectors = resolve(detectors)
        self.errors = errors or HookErrors()
        self.dropped_batches = 0
        self.examples: list[Example] = []
        self.max_examples = max_examples
        self._lock = threading.Lock()
        self._judged: dict[int | None, dict[tuple[str, str], float]] = {}    # by source step
        self._hacked: dict[int | None, dict[tuple[str, str], float]] = {}
        self._submitted = self._done = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        checkers = dict(_CHECKERS)
        if mode == "auto":
            mode = "process" if _importable([d.fn for d in self.detectors] + list(checkers.values())) else "thread"
        self.mode = mode
        self._process: subprocess.Popen | None = None
        if mode == "process":
            try:
                self._start_process(checkers)
            except Exception as exc:  # noqa: BLE001 - no child process: judge in a thread instead
                self.errors.report("hacks", "worker_start", f"detector process did not start ({exc}); using a "
                                   "thread", raise_in_strict=False)
                self.mode = "thread"
        target = self._feed_process if self.mode == "process" else self._run
        self._thread = threading.Thread(target=target, name="rlwatch-hacks", daemon=True)
        self._thread.start()

    # --- the child process ------------------------------------------------------------------------

    def _start_process(self, checkers: dict) -> None:
        from .worker import write_message

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._process = subprocess.Popen([sys.executable, "-m", "rlwatch.hacks.worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env, start_new_session=True)
        write_message(self._process.stdin, (self.detectors, checkers, self.max_examples))
        self._reader = threading.Thread(target=self._read_process, name="rlwatch-hacks-read", daemon=True)
        self._reader.start()

    def _feed_process(self) -> None:
        """Send queued batches to the child (pickling happens here, off the training thread)."""
        from .worker import write_message

        while True:
            item = self._queue.get()
            try:
                if item is None:
                    self._process.stdin.close()
                    return
                write_message(self._process.stdin, item)
            except (OSError, ValueError) as exc:       # the child died: count what it will never judge
                self.errors.report("hacks", "worker_died", f"detector process stopped: {exc}",
                                   raise_in_strict=False)
                with self._lock:
                    self._done += 1
            finally:
                self._queue.task_done()

    def _read_process(self) -> None:
        from .worker import read_message

        while True:
            try:
                result = read_message(self._process.stdout)
            except (EOFError, OSError, ValueError):
                return
            self._merge(result)

    # --- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._merge(judge_batch(self.detectors, *item, max_examples=self.max_examples, cooperative=True))
            finally:
                self._queue.task_done()

    # --- both -------------------------------------------------------------------------------------

    def submit(self, step: int, episodes: Iterable[Any], env: list[str] | None = None) -> None:
        """Queue one step's episodes (dicts or Episode); nothing is judged on this thread."""
        item = (step, list(episodes), list(env) if env is not None else None)
        try:
            self._queue.put_nowait(item)
            with self._lock:
                self._submitted += 1
        except queue.Full:
            self.dropped_batches += 1
            self.errors.report("hacks", "queue_full", "hack-detector queue full; a batch was not judged",
                               raise_in_strict=False)

    def _merge(self, result: BatchResult) -> None:
        for kind, message in result.errors:
            self.errors.report("hacks" if kind != "episodes" else "validate", kind, message, raise_in_strict=False)
        with self._lock:
            for mine, theirs in ((self._judged, result.judged), (self._hacked, result.hacked)):
                counts = mine.setdefault(result.step, {})
                for key, n in theirs.items():
                    counts[key] = counts.get(key, 0.0) + n
            room = self.max_examples - len(self.examples)
            self.examples.extend(result.examples[:max(0, room)])
            self._done += 1

    def collect_by_step(self) -> dict[int | None, Values]:
        """The verdicts finished since the last call, as counter increments keyed by the step their
        episodes came from: {source step: {"episodes_judged_total": {(env, detector): n},
        "episodes_hacked_total": {...}}} (empty when there are none)."""
        with self._lock:
            judged, hacked = self._judged, self._hacked
            self._judged, self._hacked = {}, {}
        out: dict[int | None, Values] = {}
        for step, counts in judged.items():
            if not counts:
                continue
            clean_judged, clean_hacked = _clean_keys(counts), _clean_keys(hacked.get(step, {}))
            out[step] = {"episodes_judged_total": clean_judged,
                         "episodes_hacked_total": {key: clean_hacked.get(key, 0.0) for key in clean_judged}}
        return out

    def collect(self) -> Values | None:
        """The verdicts finished since the last call, all source steps summed, as step values (None
        when there are none): counter increments, which the step pipeline adds to the step's own."""
        return sum_counts(self.collect_by_step().values())

    def take_examples(self) -> list[Example]:
        """The flagged episodes kept since the last call (detector and env names label-safe)."""
        with self._lock:
            out, self.examples = self.examples, []
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted batch was judged (False on timeout or a dead worker)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._done >= self._submitted:
                    return True
            alive = self._thread.is_alive() and (self._process is None or self._process.poll() is None)
            if time.monotonic() > deadline or not alive:
                return False
            time.sleep(0.005)

    def close(self, timeout: float = 10.0) -> None:
        """Judge what is queued (at most ``timeout`` s), then stop the worker thread and the child process."""
        self.flush(timeout)
        stop_consumer(self._queue, self._thread, 5.0)
        if self._process is not None:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
