"""rlwatch's own errors, and the one policy that keeps them out of the user's trainer.

The policy ("never raise into the trainer"), in one place:

- Every error rlwatch meets is counted in ``rlwatch_hook_errors_total{stage,kind}`` and logged
  once per (stage, kind) by :class:`HookErrors`.
- Code that runs rlwatch's side of a step or a hook goes through :func:`guard` (a call) or
  :func:`guarded` (a decorator): an exception becomes a counted error and the call returns None.
  An exception that :meth:`HookErrors.report` already counted is not counted twice.
- Strict mode (``Watch(strict=True)``, tests): the same errors are counted and logged, then raised
  to the caller, wherever the caller is: the training thread for ``observe``, the integration's
  hooks and start-up, or rlwatch's background thread (where the worker counts it as
  ``stage="background"``). Errors that happen on a thread nobody calls into (store writer, HTTP
  server, push loop, notifiers, the stall watchdog, hack detectors) are reported with
  ``raise_in_strict=False``: counted and logged only, since there is no caller to raise to.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from typing import Any, Callable, TypeVar

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

    Stages: ``validate`` (bad input), ``compute``, ``export``, ``store``, the step listeners' phases
    (``drift``, ``diagnosis``, ``alerts``: the alert step windows and the evaluator, ``listener``:
    the user's; :data:`rlwatch.hook.pipeline.LISTENER_PHASES`), ``notify``, ``hacks``, ``background``
    (rlwatch's step thread), ``observe`` (a step refused after close), ``integration`` (and the
    integrations' own hook names).
    Thread-safe: background exporters report here too.
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
            error = exc if exc is not None else InvalidFieldError(field or stage, kind, message)
            _mark_reported(error)
            raise error

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.counts)


T = TypeVar("T")
_REPORTED = "__rlwatch_reported__"


def _mark_reported(exc: BaseException) -> None:
    try:
        setattr(exc, _REPORTED, True)
    except Exception:  # noqa: BLE001 - an exception type with __slots__ is counted again, at worst
        pass


def describe(exc: BaseException) -> str:
    """The logged message of an exception: rlwatch's own errors say what they are already."""
    return str(exc) if isinstance(exc, RLWatchError) else f"{type(exc).__name__}: {exc}"


def guard(errors: HookErrors | None, stage: str, kind: str | None, func: Callable[[], T]) -> T | None:
    """``func()``, or None after counting its exception as ``(stage, kind)`` (``kind=None``: the
    exception's type name). Raises in strict mode (see the module's policy); without ``errors``
    (no Watch yet) the exception is logged and swallowed."""
    try:
        return func()
    except Exception as exc:  # noqa: BLE001 - never raise into the trainer
        if getattr(exc, _REPORTED, False):
            if errors is not None and errors.strict:
                raise
            return None
        if errors is None:
            logger.warning("rlwatch %s error (%s): %s", stage, kind or type(exc).__name__, describe(exc))
            return None
        errors.report(stage, kind or type(exc).__name__, describe(exc), exc=exc)
        return None


def guarded(errors: HookErrors | Callable[[], HookErrors | None] | None, stage: str,
            kind: str | None = None) -> Callable[[Callable[..., T]], Callable[..., T | None]]:
    """Decorator form of :func:`guard`. ``errors`` may be a callable returning the counter, for
    hooks created before their Watch (it is looked up at each call)."""
    def decorate(func: Callable[..., T]) -> Callable[..., T | None]:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> T | None:
            counter = errors() if callable(errors) and not isinstance(errors, HookErrors) else errors
            return guard(counter, stage, kind, lambda: func(*args, **kwargs))
        return inner
    return decorate
