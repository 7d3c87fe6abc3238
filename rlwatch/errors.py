"""rlwatch's own errors, and the counter that keeps them out of the user's trainer."""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("rlwatch")


class RLWatchError(Exception):
    """Base class of every error rlwatch raises (only in strict mode, or from explicit API misuse)."""


class InvalidFieldError(RLWatchError, ValueError):
    """A field of an observed step record is unusable; ``field`` names it, ``kind`` says why."""

    def __init__(self, field: str, kind: str, message: str) -> None:
        super().__init__(f"{field}: {message} [{kind}]")
        self.field = field
        self.kind = kind


class PortInUseError(RLWatchError, OSError):
    """The metrics port is taken by another process."""


class HookErrors:
    """Counts errors by (stage, kind), logs the first of each kind, and raises in strict mode.

    Stages: ``validate`` (bad input), ``compute``, ``export``, ``store``, ``alerts``, ``notify``,
    ``integration``. Thread-safe: background exporters report here too.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.counts: Counter[tuple[str, str]] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def report(self, stage: str, kind: str, message: str, field: str | None = None,
               exc: BaseException | None = None, raise_in_strict: bool = True) -> None:
        with self._lock:
            self.counts[(stage, kind)] += 1
            first = (stage, kind) not in self._logged
            self._logged.add((stage, kind))
        where = f" field {field!r}:" if field else ":"
        if first:
            logger.warning("rlwatch %s error (%s)%s %s (logged once per kind; counted in "
                           "rlwatch_hook_errors_total)", stage, kind, where, message,
                           exc_info=exc if exc is not None and not isinstance(exc, InvalidFieldError) else None)
        if self.strict and raise_in_strict:
            if exc is not None:
                raise exc
            raise InvalidFieldError(field or stage, kind, message)

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.counts)
