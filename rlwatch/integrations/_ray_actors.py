"""The Ray-actor integrations' shared part (verl, OpenRLHF): :class:`RayActorInstrumentor`, delivered
into every Ray worker by an import hook, which creates the trainer process's Watch on first use, and
the helpers that read the trainer's configuration."""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import replace
from types import ModuleType
from typing import Any, Callable, Mapping

from ..core.config import disabled, env_watch_options, rank
from ._instrumentor import Call, Instrumentor, Patch, installed_version, missing

logger = logging.getLogger("rlwatch")

__all__ = ["RayActorInstrumentor", "config_get", "framework_watch_options"]


def framework_watch_options(framework: str, environ: Mapping[str, str] | None = None, run: Any = None,
                            group_size: Any = None) -> dict[str, Any]:
    """``Watch`` keyword arguments of a Ray-actor integration: the framework and its version, the
    RLWATCH_* variables (:func:`env_watch_options`), then the run name and group size from the
    trainer's configuration where the variables give none (RLWATCH_GROUP_SIZE wins, even 0: no groups)."""
    opts: dict[str, Any] = {"framework": framework, "framework_version": installed_version(framework) or ""}
    opts.update(env_watch_options(environ))
    run = opts.get("run") or run
    if run:
        opts["run"] = str(run)
    n = opts.pop("group_size") if "group_size" in opts else group_size
    if n and int(n) > 1:
        opts["group_size"] = int(n)
    return opts


def config_get(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b.c`` for a DictConfig, a dict or nested namespaces; ``default`` when a part is missing."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
        except Exception:  # noqa: BLE001 - a struct DictConfig raises on unknown keys
            return default
    return default if node is None else node


class RayActorInstrumentor(Instrumentor):
    """An instrumentor delivered into every Ray worker by an import hook (verl, OpenRLHF), because
    their trainer loops run in Ray actors that a patch made in the launcher never reaches.

    :meth:`setup_hook` (Ray's ``worker_process_setup_hook``, run in every worker) only checks the
    version and installs an import hook: it imports nothing from the framework and starts nothing.
    When a process imports one of the modules of ``patches`` ({module name: [Patch, ...]}), their
    rows are patched; a wrapper that is never called costs nothing. The first call whose hook needs
    the Watch (``Hook(watch=True)``, made only by the trainer process) creates the process's Watch
    (its ``/metrics`` endpoint, run store and file_sd registration) from RLWATCH_* variables and the
    trainer's configuration; every other worker keeps idle wrappers and no endpoint. Ray places the
    trainer on any node: set ``RLWATCH_SD_DIR`` (a directory Prometheus reads through ``file_sd``)
    and, across hosts, ``RLWATCH_ADDR=0.0.0.0``.

    Subclasses set ``patches`` and ``label`` and implement ``_context(call)`` (the trainer object or
    arguments behind a call), ``_watch_options(context)`` and ``_watch_metadata(context)``."""

    patches: Mapping[str, list[Patch]] = {}
    label = ""

    def __init__(self) -> None:
        super().__init__()
        self.last_values: dict | None = None
        self._own_watch = False
        self._watch_kwargs: dict[str, Any] = {}
        self._watch_lock = threading.Lock()
        self._watch_failed = False
        self._finder: Any = None
        self._fallback_step = 0

    def _instrument(self, watch: Any = None, **watch_kwargs: Any) -> None:
        """``watch``: report to this Watch instead of creating one (from RLWATCH_*, the trainer's
        configuration and ``watch_kwargs``) when a hook first needs it."""
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

    def _missing(self) -> list[str]:
        """What the table patches in the framework's modules already imported and they lack (the others
        are checked as they are imported, by :meth:`_patch_module`)."""
        return [name for module_name, rows in self.patches.items() if module_name in sys.modules
                for name in missing(sys.modules[module_name], rows, module_name)]

    def _patch_module(self, module: ModuleType) -> None:
        """Patch the table's rows for ``module``. When the module lacks a class or method the table names,
        nothing is patched anywhere (:meth:`refuse`, one warning): this process goes on unwatched. A Ray
        actor class (pickled by value) is left alone, that hook off (one warning)."""
        rows = self.patches.get(module.__name__, ())
        absent = missing(module, rows, module.__name__)
        if absent:
            self.refuse(absent)
            self.uninstrument()
            return
        for owner_name, attribute, hook in rows:
            owner = module if owner_name is None else getattr(module, owner_name)
            current = getattr(owner, attribute)
            if hasattr(owner, "__ray_metadata__"):
                where = ".".join(filter(None, (module.__name__, owner_name, attribute)))
                logger.warning("rlwatch: %s is a Ray actor class in %s %s; that hook is off",
                               where, self.package, installed_version(self.package))
            elif getattr(current, "__rlwatch_original__", None) is None:
                self.patch(owner, attribute, hook)

    def resolve(self, call: Call) -> Any:
        if call.context is None:
            call.context = self._context(call)
        return self._get_watch(call.context)

    def _context(self, call: Call) -> Any:
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

        from ..hook.watch import Watch

        opts = self._watch_options(context)
        opts.update(self._watch_kwargs)
        opts.setdefault("metadata", self._watch_metadata(context))
        if "all_ranks" not in opts and rank()[0] != 0:
            # The trainer actor is the only caller; a RANK/SLURM_PROCID it inherited from the node's
            # launcher must not silence it (the run label then carries a -rankN suffix).
            opts["all_ranks"] = True
        watch = Watch(**opts)
        atexit.register(watch.close)
        logger.info("rlwatch: %s trainer process %d exports at %s", self.label, os.getpid(), watch.url)
        return watch

    def _watch_options(self, context: Any) -> dict[str, Any]:
        raise NotImplementedError

    def step_or_count(self, step: Any) -> int:
        """``step`` when the framework gives one (an int), else the next of this process's own count."""
        if isinstance(step, int):
            return step
        self._fallback_step += 1
        return self._fallback_step

    def observe(self, step: int, fields: Any, episodes: Callable[[Any], list] | None = None) -> None:
        """Hand one step's ``StepFields`` to the Watch (with ``episodes(fields)`` for the reward-hack
        detectors when it runs them) and keep its values in ``last_values``; nothing for None."""
        if fields is None:
            return
        if episodes is not None and getattr(self.watch, "hack_detection", False):
            fields = replace(fields, episodes=episodes(fields))
        self.last_values = self.watch.observe_fields(step, fields)

    def _watch_metadata(self, context: Any) -> dict[str, Any]:
        return {}

    def setup_hook(self) -> None:
        """Ray ``worker_process_setup_hook``: check the version and install the import hook, nothing
        more (the framework is not imported, no Watch is created). Never raises: a failing setup hook
        would stop the worker from starting. RLWATCH_DISABLE=1 turns it off."""
        try:
            if disabled() or self.is_instrumented:
                return
            self.instrument()
        except Exception as exc:  # noqa: BLE001
            logger.warning("rlwatch: %s setup hook failed; this worker is not instrumented: %s", self.label, exc)

    def autoload(self) -> Any:
        """``rlwatch run``'s registration of the framework (its package's ``AUTOLOAD``,
        :mod:`.registry`): at start-up, :meth:`setup_hook` (lazy itself: the framework's functions are
        wrapped when they get imported), and the Watch the instrumentor creates announced."""
        from .registry import Autoload, announce_created_watches

        def setup() -> None:
            self.setup_hook()
            announce_created_watches(self, self.package)
        return Autoload(framework=self.package, setup=setup)

    def __reduce__(self) -> tuple:
        # A wrapper pickled by value (cloudpickle) refers to the instrumentor of the process that
        # unpickles it (the module's INSTRUMENTOR), never to this one's Watch, locks and threads.
        return (_module_instrumentor, (type(self).__module__,))


def _module_instrumentor(module: str) -> RayActorInstrumentor:
    import importlib

    return importlib.import_module(module).INSTRUMENTOR
