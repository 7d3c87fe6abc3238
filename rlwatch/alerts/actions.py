"""Where alert callbacks and guard actions run: one rlwatch thread, never under rlwatch's locks.

The evaluator decides its events under its lock and hands the callbacks (``Watch.on_alert``
subscribers, ``guard`` actions) to :class:`ActionRunner`, which runs them in order on the
``rlwatch-alert-actions`` thread. A callback may therefore call any public method of the Watch or
the evaluator (``watch.evaluator.firing()``, ``watch.note``, even ``watch.close``). The step that
raised an event waits at most ``wait_seconds`` (100 ms) for its own callbacks, and only when no
earlier callback is still running (they would wait behind it anyway), so a quick guard (a stop
request to the trainer) has run when ``observe`` returns while a slow one (a checkpoint upload)
never holds the trainer longer; it finishes on the actions thread, delaying only later callbacks,
never later steps. At most :data:`MAX_QUEUED` callbacks wait; one more is dropped and counted
(``kind="actions_queue_full"``). A callback that raises is counted as
``rlwatch_hook_errors_total{stage="alerts", kind=...}``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

#: How long the step that raised an event waits for its callbacks, in seconds.
WAIT_SECONDS = 0.1
#: Callbacks that may wait behind a running one; more are dropped and counted.
MAX_QUEUED = 256


class ActionRunner:
    """Runs ``(kind, callable, event)`` actions in order on one daemon thread.

    on_error(kind, message): called for an action that raised (``kind`` is the action's).
    """

    def __init__(self, on_error: Callable[[str, str], None], wait_seconds: float = WAIT_SECONDS) -> None:
        self.wait_seconds = wait_seconds
        self._on_error = on_error
        self._queue: deque[tuple[str, Callable[[Any], None], Any]] = deque()
        self._cond = threading.Condition()
        self._submitted = self._done = 0
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, kind: str, action: Callable[[Any], None], event: Any) -> None:
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= MAX_QUEUED:
                self._on_error("actions_queue_full", f"alert {kind} dropped: {MAX_QUEUED} alert callbacks "
                                                     "already wait behind a slow one")
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rlwatch-alert-actions", daemon=True)
                self._thread.start()
            self._queue.append((kind, action, event))
            self._submitted += 1
            self._cond.notify_all()

    def mark(self) -> tuple[int, int]:
        """Where the runner stands (submitted, done): give it to :meth:`wait_own` after submitting."""
        with self._cond:
            return self._submitted, self._done

    def wait_own(self, mark: tuple[int, int]) -> bool:
        """Wait (at most ``wait_seconds``) for the actions submitted since ``mark``, only when every
        action before them had run at ``mark`` (else they queue behind a running one: no wait)."""
        submitted, done = mark
        if self._submitted == submitted or done < submitted:
            return self._done >= self._submitted
        return self.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the actions submitted so far have run (at most ``timeout`` s, default
        ``wait_seconds``); True when they have. Returns at once on the actions thread itself."""
        if threading.current_thread() is self._thread:
            return self._done >= self._submitted
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target,
                                       self.wait_seconds if timeout is None else timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Wait for what is queued (at most ``timeout`` s); the thread ends once the queue is empty
        and takes no new actions."""
        self.wait(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                kind, action, event = self._queue.popleft()
            try:
                action(event)
            except Exception as exc:  # noqa: BLE001 - a user's callback; counted, never raised
                self._on_error(kind, f"alert {kind} failed: {exc}")
            with self._cond:
                self._done += 1
                self._cond.notify_all()


__all__ = ["ActionRunner", "MAX_QUEUED", "WAIT_SECONDS"]
