"""Run hack detectors off the training thread and feed their verdicts to the step values.

``HackMonitor.submit(step, episodes)`` only enqueues (bounded; a full queue drops the batch and
counts it). A worker thread runs every applicable detector on every episode (or on a
deterministic sample for expensive ones) with a per-call timeout; a detector that raises or times
out is counted as its own error kind and its verdict is unknown, never "not hacked".
``collect()`` hands the verdicts finished since the last call to the Watch, which exports them
with the next step: ``episodes_judged_total`` / ``episodes_hacked_total`` per environment and
detector and ``env_hack_ratio`` over the judged episodes. A few flagged episodes are kept (text
truncated) for the post-mortem.

The batch-level reward/length detector is a per-environment signal computed with the other
signals (``rlwatch_env_reward_length_corr``); the DriftDetector scores its jumps against the
environment's own trailing baseline.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Iterable

from .._queues import wait_drained
from ..errors import HookErrors
from .registry import Detector, Episode, as_verdict, resolve

EXAMPLE_CHARS = 400


@dataclass
class Example:
    step: int | None
    env: str
    detector: str
    reason: str
    prompt: str
    response: str
    reward: float


def _text(ep: Episode, which: str) -> str:
    text = getattr(ep, which)
    if text is None:
        ids = getattr(ep, f"{which}_ids")
        text = " ".join(map(str, ids)) if ids is not None else ""
    return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "…"


def sampled(detector: Detector, ep: Episode) -> bool:
    """Deterministic sampling: the same episode is judged or skipped on every replay."""
    if detector.sample_rate >= 1.0:
        return True
    key = f"{detector.name}|{ep.step}|{ep.index}|{ep.env}".encode()
    return (zlib.crc32(key) / 2**32) < detector.sample_rate


class HackMonitor:
    """Background hack detection for one run."""

    def __init__(self, detectors: Iterable[Detector | str] | None = None, errors: HookErrors | None = None,
                 max_queue: int = 64, max_examples: int = 20, threads: int = 2) -> None:
        self.detectors = resolve(detectors)
        self.errors = errors or HookErrors()
        self.dropped_batches = 0
        self.examples: list[Example] = []
        self.max_examples = max_examples
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._judged: dict[tuple[str, str], float] = {}
        self._hacked: dict[tuple[str, str], float] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rlwatch-hack")
        self._thread = threading.Thread(target=self._run, name="rlwatch-hacks", daemon=True)
        self._thread.start()

    def submit(self, step: int, episodes: Iterable[Any], env: list[str] | None = None) -> None:
        try:
            batch = [Episode.coerce(ep, step=step, index=i, env=env[i] if env and i < len(env) else None)
                     for i, ep in enumerate(episodes)]
        except Exception as exc:  # noqa: BLE001
            self.errors.report("validate", "episodes", f"cannot read episodes: {exc}", field="episodes")
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped_batches += 1
            self.errors.report("hacks", "queue_full", "hack-detector queue full; a batch was not judged",
                               raise_in_strict=False)

    def _judge(self, detector: Detector, ep: Episode) -> None:
        future = self._pool.submit(detector.fn, ep)
        try:
            verdict = as_verdict(future.result(timeout=detector.timeout))
        except concurrent.futures.TimeoutError:
            self.errors.report("hacks", "detector_timeout", f"{detector.name} took over {detector.timeout}s",
                               raise_in_strict=False)
            return
        except Exception as exc:  # noqa: BLE001 - a detector's bug is its own error kind, not "honest"
            self.errors.report("hacks", "detector_error", f"{detector.name}: {type(exc).__name__}: {exc}",
                               raise_in_strict=False)
            return
        if verdict is None:
            return
        key = (ep.env, detector.name)
        with self._lock:
            self._judged[key] = self._judged.get(key, 0.0) + 1
            if verdict.hacked:
                self._hacked[key] = self._hacked.get(key, 0.0) + 1
                if len(self.examples) < self.max_examples:
                    self.examples.append(Example(ep.step, ep.env, detector.name, verdict.reason,
                                                 _text(ep, "prompt"), _text(ep, "response"), ep.reward))

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                self._queue.task_done()
                return
            for ep in batch:
                for det in self.detectors:
                    if det.applies_to(ep.env) and sampled(det, ep):
                        self._judge(det, ep)
            self._queue.task_done()

    def collect(self) -> dict[str, dict[tuple[str, ...], float]] | None:
        """Verdicts finished since the last call, as step values (None when there are none)."""
        with self._lock:
            judged, hacked = self._judged, self._hacked
            self._judged, self._hacked = {}, {}
        if not judged:
            return None
        return {
            "episodes_judged_total": {(env, det): n for (env, det), n in judged.items()},
            "episodes_hacked_total": {(env, det): hacked.get((env, det), 0.0) for env, det in judged},
            "env_hack_ratio": {(env, det): hacked.get((env, det), 0.0) / n for (env, det), n in judged.items()},
        }

    def take_examples(self) -> list[Example]:
        with self._lock:
            out, self.examples = self.examples, []
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        return wait_drained(self._queue, timeout, self._thread.is_alive)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

