"""Background work off the training thread: an ordered worker, and waiting for a queue to drain
(store writer, notifier, hack detectors, deferred steps)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable


def wait_drained(q: queue.Queue, timeout: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """True once every item put on ``q`` was marked done; False on timeout or when the worker died."""
    deadline = time.monotonic() + timeout
    while q.unfinished_tasks:
        if time.monotonic() > deadline or not alive():
            return False
        time.sleep(0.005)
    return True


class OrderedWorker:
    """One daemon thread that runs submitted callables in submission order.

    The queue is bounded: when the worker is ``maxsize`` jobs behind, ``submit`` waits for it
    (back-pressure, nothing reordered), but at most ``max_wait`` seconds: a worker stuck that long
    costs the job (reported through ``on_error``), never the caller's progress. A job that raises
    is reported through ``on_error`` and the worker carries on."""

    def __init__(self, name: str, on_error: Callable[[BaseException], Any], maxsize: int = 64,
                 initializer: Callable[[], Any] | None = None, max_wait: float = 5.0) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize)
        self.max_wait = max_wait
        if initializer is not None:
            self._queue.put(initializer)      # the thread's first job
        self._on_error = on_error
        self.busy_seconds = 0.0           # CPU time of this thread spent in jobs (benchmarks)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> bool:
        """Queue ``job``; False (reported) when the worker stayed full for ``max_wait`` seconds."""
        try:
            self._queue.put(job, timeout=self.max_wait)
            return True
        except queue.Full:
            self._on_error(TimeoutError(f"worker {self.max_wait:g} s behind; a job was dropped"))
            return False

    def is_current(self) -> bool:
        """Whether the caller runs on this worker's thread (where ``submit`` could wait on itself)."""
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            started = time.thread_time()
            try:
                if job is None:
                    return
                job()
            except BaseException as exc:  # noqa: BLE001 - the worker must outlive any job
                self._on_error(exc)
            finally:
                self.busy_seconds += time.thread_time() - started
                self._queue.task_done()

    def drain(self, timeout: float) -> bool:
        """True once every job submitted so far has run."""
        return wait_drained(self._queue, timeout, self._thread.is_alive)

    def close(self, timeout: float) -> bool:
        """Run what is queued (up to ``timeout`` s), then stop the thread."""
        done = self.drain(timeout)
        try:
            self._queue.put_nowait(None)      # a worker stuck in a job keeps a full queue: leave it
        except queue.Full:
            return False
        self._thread.join(timeout=1.0 if done else 0.0)
        return done
