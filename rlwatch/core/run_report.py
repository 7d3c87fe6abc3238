"""What a process tells ``rlwatch run`` (:mod:`rlwatch.ops.autoload`): one JSON line appended to the
``RLWATCH_RUN_REPORT`` file, when it is set."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from . import config

logger = logging.getLogger("rlwatch")


def report(event: str, **fields: Any) -> None:
    """Append ``{"event": event, "pid": ..., **fields}`` to the RLWATCH_RUN_REPORT file (if set)."""
    path = config.run_report_path()
    if not path:
        return
    try:
        line = json.dumps({"event": event, "pid": os.getpid(), **fields}, default=str) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())              # one short O_APPEND write: lines never interleave
        finally:
            os.close(fd)
    except Exception as exc:  # noqa: BLE001 - reporting never disturbs the program
        logger.debug("rlwatch: could not write the run report: %s", exc)
