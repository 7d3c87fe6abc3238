"""Background work off the training thread: an ordered worker, waiting for a queue to drain and
stopping its consumer (store writer, notifier, hack detectors, deferred steps)."""

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


def stop_consumer(q: queue.Queue, thread: threading.Thread, join_timeout: float) -> None:
    """Ask the thread consuming ``q`` to stop (the end marker None, queued behind what is there; at most
    1 s waiting for room) and wait up to ``join_timeout`` seconds for it. A consumer stuck in an item
    is left behind (a daemon thread): the caller never hangs on it."""
    try:
        q.put(None, timeout=1)
    except queue.Full:
        pass
    thread.join(timeout=join_timeout)


class OrderedWorker:
    """One daemon thread that runs submitted callables in submission order.

    The queue is bounded by jobs (``maxsize``) and by the bytes the jobs hold (``max_bytes``, as
    the caller declares them: a queued step keeps its input tensors alive, on an accelerator in
    device memory). When either bound is reached, ``submit`` waits for the worker (back-pressure,
    nothing reordered), but at most ``max_wait`` seconds: a worker stuck that long costs the job
    (reported through ``on_error``), never the caller's progress. A job that raises is reported
    through ``on_error`` and the worker carries on. After ``close`` starts, jobs are refused
    (``submit`` returns False and ``refused`` counts them); none is ever dropped silently."""

    def __init__(self, name: str, on_error: Callable[[BaseException], Any], maxsize: int = 64,
                 initializer: Callable[[], Any] | None = None, max_wait: float = 5.0,
                 max_bytes: int | None = None) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize)
        self.max_wait = max_wait
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.peak_bytes = 0
        self.refused = 0
        self.dropped = 0                  # jobs dropped because the worker stayed full for max_wait
        self._closed = False
        self._inflight = 0
        self._cond = threading.Condition()
        if initializer is not None:
            self._queue.put((initializer, 0))      # the thread's first job
        self._on_error = on_error
        self.busy_seconds = 0.0           # CPU time of this thread spent in jobs (benchmarks)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any], nbytes: int = 0) -> bool:
        """Queue ``job`` (holding ``nbytes``); False when refused (closing) or when the worker stayed
        full for ``max_wait`` seconds (reported)."""
        deadline = time.monotonic() + self.max_wait
        with self._cond:
            if self._closed:
                self.refused += 1
                return False
            if self.max_bytes is not None:
                while self.queued_bytes and self.queued_bytes + nbytes > self.max_bytes and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.dropped += 1
                        self._on_error(TimeoutError(f"worker {self.max_wait:g} s behind ({self.queued_bytes} "
                                                    "bytes queued); a job was dropped"))
                        return False
                    self._cond.wait(left)
                if self._closed:
                    self.refused += 1
                    return False
            self.queued_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.queued_bytes)
            self._inflight += 1
        try:
            self._queue.put((job, nbytes), timeout=max(0.0, deadline - time.monotonic()))
            return True
        except queue.Full:
            self._release(nbytes)
            self.dropped += 1
            self._on_error(TimeoutError(f"worker {self.max_wait:g} s behind; a job was dropped"))
            return False
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self.queued_bytes -= nbytes
            self._cond.notify_all()

    def is_current(self) -> bool:
        """Whether the caller runs on this worker's thread (where ``submit`` could wait on itself)."""
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            started = time.thread_time()
            try:
                if item is None:
                    return
                job, nbytes = item
                try:
                    job()
                finally:
                    del job, item            # the job's inputs are freed before the next one runs
                    self._release(nbytes)
            except BaseException as exc:  # noqa: BLE001 - the worker must outlive any job
                self._on_error(exc)
            finally:
                self.busy_seconds += time.thread_time() - started
                self._queue.task_done()

    def drain(self, timeout: float) -> bool:
        """True once every job submitted so far has run."""
        return wait_drained(self._queue, timeout, self._thread.is_alive)

    def close(self, timeout: float) -> bool:
        """Refuse new jobs, run what is queued (up to ``timeout`` s), then stop the thread."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()          # submitters waiting for room give up: refused, counted
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(0.05)
        done = self.drain(max(0.0, deadline - time.monotonic()))
        try:
            self._queue.put_nowait(None)      # a worker stuck in a job keeps a full queue: leave it
        except queue.Full:
            return False
        self._thread.join(timeout=1.0 if done else 0.0)
        return done
