"""The life cycle every integration shares, after OpenTelemetry's ``BaseInstrumentor``, and the
one wrapper every patch goes through.

An integration declares the framework package, the versions it supports (``supported``, a
``packaging`` specifier set such as ``">=0.9,<0.10"``) and a table of :class:`Patch` entries:
(owner, attribute, :class:`Hook`). ``instrument()`` checks the installed version and refuses with
one clear log line (nothing patched) outside that range; a second call warns and does nothing;
``uninstrument()`` restores every original attribute from the patch-restore registry.

Every patched function is :meth:`Instrumentor.wrap`: it calls the original with the arguments it
was given (a ``before`` hook may swap one argument for a copy with rlwatch's keys added: the
trainer-logs mirror) and returns its result untouched. The hooks around it only read the call's
inputs and output. Each hook runs under ``guarded``: an error on rlwatch's side goes to the Watch's
``HookErrors`` (counted in ``rlwatch_hook_errors_total``; logged as a warning while there is no
Watch), never into the trainer (unless the Watch is strict). Hooks run on the thread that calls
the patched function (the trainer's); what they hand to the Watch may then be computed on
rlwatch's own thread (``Watch(background=True)``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
import logging
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from ..core.errors import guarded as errors_guarded

logger = logging.getLogger("rlwatch")

__all__ = ["Call", "Hook", "Instrumentor", "Patch", "caller_self", "context_value", "guarded", "installed_version",
           "version_supported"]


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_supported(version: str, supported: str) -> bool:
    """Whether ``version`` satisfies the specifier set ``supported`` (development and pre-releases of
    a supported release count; an unparsable version does not)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:
        return SpecifierSet(supported).contains(version, prereleases=True)
    except InvalidVersion:
        return False


# --- the patch table ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hook:
    """What a patched function does besides calling the original. ``before``, ``after`` and
    ``around`` name methods of the instrumentor: ``before(call)`` and ``after(call)`` (the original's
    return value in ``call.result``) run guarded under ``kind``; ``around(call)`` returns a context
    manager entered around the original (not guarded: it must not raise, so it only sets flags or a
    context variable). ``watch=True``: the hooks need the Watch, created on this call if there is none yet
    (:meth:`._ray_actors.RayActorInstrumentor.resolve`); they are skipped when none could be created."""

    kind: str
    before: str | None = None
    after: str | None = None
    around: str | None = None
    watch: bool = False


class Patch(NamedTuple):
    """One row of an integration's table: ``owner`` (a class name in the target module or object,
    None for the target itself), the attribute replaced, and its hook."""

    owner: str | None
    attribute: str
    hook: Hook


class Call:
    """One call of a patched function, as the hooks see it: positional ``args`` (``self`` first for
    a method patched on a class), ``kwargs``, the calling frame, the result once the original
    returned, and ``state`` / ``context`` / ``watch`` that the hooks of this one call share."""

    __slots__ = ("args", "kwargs", "caller", "result", "state", "context", "watch")

    def __init__(self, args: tuple, kwargs: dict, caller: FrameType | None) -> None:
        self.args, self.kwargs, self.caller = args, kwargs, caller
        self.result: Any = None
        self.state: Any = None
        self.context: Any = None
        self.watch: Any = None

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """The argument passed as ``name=`` or at position ``index``."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[index] if len(self.args) > index else default

    def replace_arg(self, index: int, name: str, value: Any) -> None:
        """Pass ``value`` to the original in place of the argument ``name`` / at ``index``."""
        if name in self.kwargs or len(self.args) <= index:
            self.kwargs[name] = value
        else:
            self.args = (*self.args[:index], value, *self.args[index + 1:])


@contextlib.contextmanager
def context_value(variable: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """``variable`` set to ``value`` inside the block (an ``around`` hook's usual body)."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def missing(target: Any, patches: Iterable[Patch], where: str = "") -> list[str]:
    """The dotted names (``where.Owner.method``) of the rows of ``patches`` whose class or method ``target``
    (a module or an object) lacks: what a framework release renamed or removed."""
    absent = []
    for owner_name, attribute, _ in patches:
        owner = target if owner_name is None else getattr(target, owner_name, None)
        if owner is None or getattr(owner, attribute, None) is None:
            absent.append(".".join(filter(None, (where, owner_name, attribute))))
    return absent


# --- the instrumentor -----------------------------------------------------------------------------

class Instrumentor:
    """Base class: subclasses set ``package`` and ``supported`` and implement ``_instrument(**kwargs)``
    / ``_uninstrument()``, patching with :meth:`patch` (or :meth:`apply` for a whole table)."""

    package: str = ""
    supported: str = ""

    def __init__(self) -> None:
        self._instrumented = False
        self._originals: list[tuple[Any, str, Any, bool]] = []
        self.watch: Any = None

    @property
    def is_instrumented(self) -> bool:
        return self._instrumented

    def instrument(self, **kwargs: Any) -> bool:
        """Patch the framework; False (with one warning) when already done or unsupported. A Ray-actor
        integration takes ``watch`` (report to this Watch instead of creating one) and ``Watch``
        keyword arguments for the Watch it creates."""
        if self._instrumented:
            logger.warning("rlwatch: %s is already instrumented; ignoring the second call", self.package)
            return False
        version = installed_version(self.package)
        if version is None:
            logger.warning("rlwatch: %s is not installed; nothing patched", self.package)
            return False
        if not version_supported(version, self.supported):
            logger.warning("rlwatch: the %s integration supports %s %s, found %s; nothing patched",
                           self.package, self.package, self.supported, version)
            return False
        absent = self._missing()
        if absent:
            self.refuse(absent)
            return False
        try:
            self._instrument(**kwargs)
        except Exception:
            self._restore()
            raise
        self._instrumented = True
        logger.info("rlwatch: instrumented %s %s", self.package, version)
        return True

    def _missing(self) -> list[str]:
        """What the integration would patch now and the installed framework lacks (see :func:`missing`)."""
        return []

    def refuse(self, absent: list[str]) -> None:
        """One line naming what the installed framework lacks; nothing is (or stays) patched, so the run
        goes on unwatched rather than half-watched."""
        logger.warning("rlwatch: %s %s has no %s, which the rlwatch integration patches; nothing is patched "
                       "and this run goes on unwatched", self.package, installed_version(self.package),
                       ", ".join(absent))

    def uninstrument(self) -> None:
        """Restore every patched attribute (and, for Ray actors, remove the import hook and close the
        Watch rlwatch created)."""
        if not self._instrumented:
            return
        self._uninstrument()
        self._restore()
        self._instrumented = False

    def _instrument(self, **kwargs: Any) -> None:
        raise NotImplementedError

    def _uninstrument(self) -> None:
        pass

    # the patch-restore registry

    def apply(self, target: Any, patches: Iterable[Patch]) -> None:
        """Patch every row of ``patches`` on ``target`` (a module or an object)."""
        for owner, attribute, hook in patches:
            self.patch(target if owner is None else getattr(target, owner), attribute, hook)

    def patch(self, owner: Any, name: str, hook: Hook) -> None:
        """Replace ``owner.name`` with :meth:`wrap` of it; restored by ``uninstrument``."""
        self.replace(owner, name, self.wrap(getattr(owner, name), hook))

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering what to restore (or delete) on ``uninstrument``."""
        had = name in vars(owner) if hasattr(owner, "__dict__") else True
        self._originals.append((owner, name, getattr(owner, name) if had else None, had))
        setattr(owner, name, value)

    def _restore(self) -> None:
        for owner, name, original, had in reversed(self._originals):
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._originals.clear()

    # the one wrapper

    def wrap(self, original: Callable, hook: Hook) -> Callable:
        """The function that replaces ``original``: the original alone once uninstrumented, else
        ``before`` -> (``around``) original -> ``after``, each hook guarded (see the module docstring)."""
        instrumentor = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not instrumentor._instrumented:
                return original(*args, **kwargs)
            call = Call(args, kwargs, sys._getframe(1))
            if hook.before is not None:
                instrumentor._run(hook, hook.before, call)
            around = getattr(instrumentor, hook.around)(call) if hook.around else contextlib.nullcontext()
            with around:
                call.result = original(*call.args, **call.kwargs)
            if hook.after is not None:
                instrumentor._run(hook, hook.after, call)
            return call.result

        functools.update_wrapper(wrapper, original)
        wrapper.__rlwatch_original__ = original
        return wrapper

    def _run(self, hook: Hook, method: str, call: Call) -> None:
        if hook.watch:
            if call.watch is None:
                call.watch = self.resolve(call)
            if call.watch is None:
                return
        guarded(self.watch, hook.kind)(getattr(self, method))(call)

    def resolve(self, call: Call) -> Any:
        """The Watch the hooks of ``call`` report to (see :class:`._ray_actors.RayActorInstrumentor`)."""
        return self.watch


def guarded(watch: Any, kind: str) -> Callable[[Callable], Callable]:
    """Decorator: run rlwatch's side of a hook without ever raising into the trainer (the one policy of
    :mod:`rlwatch.core.errors`; the Watch's error counter is looked up at each call)."""
    return errors_guarded(lambda: getattr(watch, "errors", None), "integration", kind)


def caller_self(frame: FrameType | None, accept: Callable[[Any], bool], depth: int) -> Any:
    """The first ``self`` that ``accept`` takes among ``depth`` frames from ``frame`` outwards, else None."""
    while frame is not None and depth > 0:
        candidate = frame.f_locals.get("self")
        if candidate is not None and accept(candidate):
            return candidate
        frame, depth = frame.f_back, depth - 1
    return None
