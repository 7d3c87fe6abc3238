"""Waiting for a background worker's queue to drain (store writer, notifier, hack detectors)."""

from __future__ import annotations

import queue
import time
from typing import Callable


def wait_drained(q: queue.Queue, timeout: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """True once every item put on ``q`` was marked done; False on timeout or when the worker died."""
    deadline = time.monotonic() + timeout
    while q.unfinished_tasks:
        if time.monotonic() > deadline or not alive():
            return False
        time.sleep(0.005)
    return True
