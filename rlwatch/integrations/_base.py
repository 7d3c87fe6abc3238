"""The life cycle every integration shares, after OpenTelemetry's ``BaseInstrumentor``.

An integration declares the framework package and the version range it was written against.
``instrument()`` checks the installed version and refuses with one clear log line (nothing
patched) outside that range; a second call warns and does nothing; ``uninstrument()`` restores
every original attribute. Patches never change the trainer's numbers: wrappers call the original
and only read its inputs and outputs, and anything rlwatch does in between is guarded so that an
error is counted and logged, never raised into the trainer (unless the Watch is strict).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import re
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Mapping

logger = logging.getLogger("rlwatch")


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: '0.9.1.dev0' -> (0, 9, 1)."""
    numbers = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(x) for x in numbers.group(0).split(".")) if numbers else ()


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_in_range(version: str, minimum: tuple[int, ...], below: tuple[int, ...]) -> bool:
    v = parse_version(version)
    return minimum <= v < below


class Instrumentor:
    """Base class: subclasses set ``package``, ``minimum`` and ``below`` and implement
    ``_instrument(**kwargs)`` / ``_uninstrument()`` (usually with :meth:`patch`)."""

    package: str = ""
    minimum: tuple[int, ...] = ()
    below: tuple[int, ...] = ()

    def __init__(self) -> None:
        self._instrumented = False
        self._originals: list[tuple[Any, str, Any, bool]] = []

    @property
    def supported(self) -> str:
        return f">={'.'.join(map(str, self.minimum))},<{'.'.join(map(str, self.below))}"

    @property
    def is_instrumented(self) -> bool:
        return self._instrumented

    def instrument(self, **kwargs: Any) -> bool:
        """Patch the framework; False (with one warning) when already done or unsupported."""
        if self._instrumented:
            logger.warning("rlwatch: %s is already instrumented; ignoring the second call", self.package)
            return False
        version = installed_version(self.package)
        if version is None:
            logger.warning("rlwatch: %s is not installed; nothing patched", self.package)
            return False
        if not version_in_range(version, self.minimum, self.below):
            logger.warning("rlwatch: the %s integration supports %s %s, found %s; nothing patched",
                           self.package, self.package, self.supported, version)
            return False
        try:
            self._instrument(**kwargs)
        except Exception:
            self._restore()
            raise
        self._instrumented = True
        logger.info("rlwatch: instrumented %s %s", self.package, version)
        return True

    def uninstrument(self) -> None:
        if not self._instrumented:
            return
        self._uninstrument()
        self._restore()
        self._instrumented = False

    def _instrument(self, **kwargs: Any) -> None:
        raise NotImplementedError

    def _uninstrument(self) -> None:
        pass

    def patch(self, owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
        """Replace ``owner.name`` with ``make_wrapper(original)``; restored by ``uninstrument``."""
        had = name in vars(owner) if hasattr(owner, "__dict__") else True
        original = getattr(owner, name)
        wrapper = make_wrapper(original)
        functools.update_wrapper(wrapper, original)
        wrapper.__rlwatch_original__ = original
        self._originals.append((owner, name, original if had else None, had))
        setattr(owner, name, wrapper)

    def _restore(self) -> None:
        for owner, name, original, had in reversed(self._originals):
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._originals.clear()


def env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A yes/no variable: unset or empty = ``default``; 0/false/no/off = False; anything else True."""
    value = environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def env_watch_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``Watch`` keyword arguments from the RLWATCH_* variables that every delivery path shares:
    RLWATCH_RUN, RLWATCH_PORT (``none``/``off``/``-1``: no endpoint), RLWATCH_ADDR,
    RLWATCH_PORT_FALLBACK (default on), RLWATCH_STORE (``none``/``off``/``0``: no store),
    RLWATCH_SD_DIR, RLWATCH_STALENESS_BOUND, RLWATCH_GROUP_SIZE, RLWATCH_STRICT."""
    env = os.environ if environ is None else environ
    opts: dict[str, Any] = {}
    if env.get("RLWATCH_RUN"):
        opts["run"] = env["RLWATCH_RUN"]
    port = (env.get("RLWATCH_PORT") or "").strip()
    if port:
        opts["port"] = None if port.lower() in ("none", "off", "-1") else int(port)
    if env.get("RLWATCH_ADDR"):
        opts["addr"] = env["RLWATCH_ADDR"]
    opts["port_fallback"] = env_flag(env, "RLWATCH_PORT_FALLBACK", True)
    store = (env.get("RLWATCH_STORE") or "").strip()
    if store:
        opts["store"] = None if store.lower() in ("none", "off", "0") else store
    if env.get("RLWATCH_SD_DIR"):
        opts["sd_dir"] = env["RLWATCH_SD_DIR"]
    if env.get("RLWATCH_STALENESS_BOUND"):
        opts["staleness_bound"] = float(env["RLWATCH_STALENESS_BOUND"])
    if env.get("RLWATCH_GROUP_SIZE"):
        opts["group_size"] = int(env["RLWATCH_GROUP_SIZE"])
    opts["strict"] = env_flag(env, "RLWATCH_STRICT", False)
    return opts


class RayActorInstrumentor(Instrumentor):
    """An instrumentor delivered into every Ray worker by an import hook (verl, OpenRLHF): it patches
    the modules of ``patches`` as they are imported, and the first trainer call that reaches it
    creates the process's Watch, from RLWATCH_* variables and the trainer's own configuration.

    Subclasses set ``patches`` ({module name: [...]}, the import hook's targets) and ``label``, and
    implement ``_patch_module``, ``_watch_options(context)`` and ``_watch_metadata(context)``."""

    patches: Mapping[str, Any] = {}
    label = ""

    def __init__(self) -> None:
        super().__init__()
        self.watch: Any = None
        self.last_values: dict | None = None
        self._own_watch = False
        self._watch_kwargs: dict[str, Any] = {}
        self._watch_lock = threading.Lock()
        self._watch_failed = False
        self._finder: Any = None
        self._fallback_step = 0

    def _instrument(self, watch: Any = None, **watch_kwargs: Any) -> None:
        """``watch``: report to this Watch instead of creating one (from RLWATCH_*, the trainer's
        configuration and ``watch_kwargs``) when a wrapped function is first called."""
        from ._imports import PostImportFinder

        self.watch = watch
        self._own_watch = False
        self._watch_kwargs = watch_kwargs
        self._watch_failed = False
        for name in self.patches:
            module = sys.modules.get(name)
            if module is not None:
                self._patch_module(module)
        self._finder = PostImportFinder(self.patches, self._on_import)
        sys.meta_path.insert(0, self._finder)

    def _uninstrument(self) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        if self._own_watch and self.watch is not None:
            self.watch.close()
        self.watch = None
        self._own_watch = False

    def _on_import(self, module: ModuleType) -> None:
        if not self._instrumented:
            return
        try:
            self._patch_module(module)
        except Exception as exc:  # noqa: BLE001 - an import must never fail because of rlwatch
            logger.warning("rlwatch: could not instrument %s: %s", module.__name__, exc)

    def _patch_module(self, module: ModuleType) -> None:
        raise NotImplementedError

    def _get_watch(self, context: Any = None) -> Any:
        """The process's Watch, created on first use (None, with one warning, if that failed)."""
        if self.watch is not None or self._watch_failed:
            return self.watch
        with self._watch_lock:
            if self.watch is None and not self._watch_failed:
                try:
                    self.watch = self._make_watch(context)
                    self._own_watch = True
                except Exception as exc:  # noqa: BLE001
                    self._watch_failed = True
                    logger.warning("rlwatch: could not start the Watch in this %s process: %s", self.label, exc)
        return self.watch

    def _make_watch(self, context: Any) -> Any:
        import atexit

        from ..watch import Watch, _rank

        opts = self._watch_options(context)
        opts.update(self._watch_kwargs)
        opts.setdefault("metadata", self._watch_metadata(context))
        if "all_ranks" not in opts and _rank()[0] != 0:
            # The trainer actor is the only caller; a RANK/SLURM_PROCID it inherited from the node's
            # launcher must not silence it (the run label then carries a -rankN suffix).
            opts["all_ranks"] = True
        watch = Watch(**opts)
        atexit.register(watch.close)
        logger.info("rlwatch: %s trainer process %d exports at %s", self.label, os.getpid(), watch.url)
        return watch

    def _watch_options(self, context: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _watch_metadata(self, context: Any) -> dict[str, Any]:
        return {}


def run_setup_hook(instrumentor: RayActorInstrumentor) -> None:
    """Body of a Ray ``worker_process_setup_hook``: check the version and install the import hook,
    nothing more (the framework is not imported, no Watch is created). Never raises: a failing
    setup hook would stop the worker from starting. RLWATCH_DISABLE=1 turns it off."""
    try:
        if env_flag(os.environ, "RLWATCH_DISABLE", False) or instrumentor.is_instrumented:
            return
        instrumentor.instrument()
    except Exception as exc:  # noqa: BLE001
        logger.warning("rlwatch: %s setup hook failed; this worker is not instrumented: %s", instrumentor.label, exc)


def guarded(watch: Any, kind: str) -> Callable[[Callable], Callable]:
    """Decorator: run rlwatch's side of a hook without ever raising into the trainer."""
    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                errors = getattr(watch, "errors", None)
                if errors is None:
                    logger.warning("rlwatch %s hook failed: %s", kind, exc)
                    return None
                errors.report("integration", kind, f"{type(exc).__name__}: {exc}", exc=exc)
                return None
        return inner
    return decorate
