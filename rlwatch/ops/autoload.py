"""Zero-code instrumentation: what ``rlwatch run -- <command>`` installs in every Python process.

``rlwatch run`` puts ``rlwatch/_bootstrap`` first on ``PYTHONPATH``; its ``sitecustomize`` calls
:func:`initialize`, which registers post-import hooks: when the training program imports a
supported framework, the matching integration attaches itself (TRL: every ``GRPOTrainer`` gets a
Watch; verl and OpenRLHF: their metric functions are wrapped). Nothing else happens in a process
that never imports a framework. When the program calls ``ray.init``, the runtime environment is
extended so that Ray workers load the same bootstrap (``worker_process_setup_hook`` and the
``RLWATCH_*`` variables), which is how the hook reaches trainer loops that run inside actors.

Configuration travels in environment variables: ``RLWATCH_RUN``, ``RLWATCH_PORT``,
``RLWATCH_ADDR``, ``RLWATCH_DIR``, ``RLWATCH_SD_DIR``, ``RLWATCH_FRAMEWORKS`` (comma list,
default all), ``RLWATCH_STRICT``.

Each Watch created this way says on stderr where its metrics and store are, and, when
``RLWATCH_RUN_REPORT`` names a file (``rlwatch run`` sets it), appends one JSON line about it there,
as it does for each supported framework the process imports: from that file ``rlwatch run`` tells,
after the command, what was watched or why nothing was.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from ..core import config
from ..core.run_report import report

logger = logging.getLogger("rlwatch")

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "_bootstrap")
_initialized = False
_hooks: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.RLock()


def watch_options_from_env() -> dict[str, Any]:
    """Watch keyword arguments configured through RLWATCH_* variables."""
    from ..core.config import env_watch_options

    return env_watch_options()


def _dispatch(module: Any) -> None:
    with _lock:
        hooks = _hooks.pop(module.__name__, [])
    for hook in hooks:
        try:
            hook(module)
        except Exception as exc:  # noqa: BLE001 - never break the user's import
            logger.warning("rlwatch: hook on import of %s failed: %s", module.__name__, exc)


def on_import(module_name: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (at once if it already is)."""
    from ..integrations._imports import PostImportFinder

    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _hooks.setdefault(module_name, []).append(hook)
            sys.meta_path.insert(0, PostImportFinder([module_name], _dispatch))
            return
    hook(module)


# --- what `rlwatch run` is told --------------------------------------------------------------------



def announce(watch: Any, framework: str) -> None:
    """Say where a zero-code Watch exports (stderr) and record it for ``rlwatch run``."""
    try:
        url, store = getattr(watch, "url", None), getattr(watch, "store_path", None)
        if not getattr(watch, "active", True):
            print(f"rlwatch: {framework} trainer in process {os.getpid()} (rank {getattr(watch, 'rank', '?')}) "
                  f"exports nothing: only rank 0 does", file=sys.stderr, flush=True)
        else:
            print(f"rlwatch: watching {framework} run {watch.run!r}: metrics "
                  f"{url or 'not served (port off or taken)'}, store {store or 'none'}", file=sys.stderr, flush=True)
        report("watching", framework=framework, run=watch.run, url=url, store=store,
               active=bool(getattr(watch, "active", True)))
    except Exception as exc:  # noqa: BLE001
        logger.debug("rlwatch: could not announce the Watch: %s", exc)


def _note_import(framework: str) -> Callable[[Any], None]:
    def hook(module: Any) -> None:
        from ..integrations._instrumentor import installed_version

        report("imported", framework=framework, version=installed_version(framework))
    return hook


def _announce_created_watches(instrumentor: Any, framework: str) -> None:
    """Make a Ray-actor instrumentor announce the Watch it creates on first use."""
    original = instrumentor._make_watch
    if getattr(original, "__rlwatch_announces__", False):
        return

    def _make_watch(context: Any) -> Any:
        watch = original(context)
        announce(watch, framework)
        return watch

    _make_watch.__rlwatch_announces__ = True
    instrumentor._make_watch = _make_watch


# --- what is hooked -------------------------------------------------------------------------------

def _hook_trl(module: Any) -> None:
    """Every GRPOTrainer built in this process gets a Watch when its constructor returns."""
    cls = getattr(module, "GRPOTrainer", None)
    if cls is None or getattr(cls.__init__, "__rlwatch_original__", None) is not None:
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            from ..integrations import trl as integration

            announce(integration.watch(self, **watch_options_from_env()), "trl")
        except Exception as exc:  # noqa: BLE001 - never stop the user's trainer from being built
            logger.warning("rlwatch: could not watch this GRPOTrainer: %s", exc)

    __init__.__rlwatch_original__ = original
    cls.__init__ = __init__


def _setup_verl() -> None:
    from ..integrations import verl

    verl.setup_hook()             # lazy itself: wraps verl's functions when verl gets imported
    _announce_created_watches(verl.INSTRUMENTOR, "verl")


def _setup_openrlhf() -> None:
    from ..integrations import openrlhf

    openrlhf.setup_hook()
    _announce_created_watches(openrlhf.INSTRUMENTOR, "openrlhf")


#: what initialize() does per framework (each one is lazy: nothing runs until the framework loads)
FRAMEWORK_SETUP: dict[str, Callable[[], None]] = {
    "trl": lambda: on_import("trl.trainer.grpo_trainer", _hook_trl),
    "verl": _setup_verl,
    "openrlhf": _setup_openrlhf,
}


def _hook_ray(module: Any) -> None:
    """Extend ``ray.init``'s runtime_env so that Ray workers load rlwatch's bootstrap too."""
    original = module.init
    if getattr(original, "__rlwatch_original__", None) is not None:
        return

    def init(*args: Any, **kwargs: Any) -> Any:
        try:
            runtime_env = dict(kwargs.get("runtime_env") or {})
            env_vars = dict(runtime_env.get("env_vars") or {})
            for key, value in config.rlwatch_variables().items():
                env_vars.setdefault(key, value)
            paths = [BOOTSTRAP_DIR] + [p for p in env_vars.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
                                       .split(os.pathsep) if p and p != BOOTSTRAP_DIR]
            env_vars["PYTHONPATH"] = os.pathsep.join(paths)
            runtime_env["env_vars"] = env_vars
            runtime_env.setdefault("worker_process_setup_hook", "rlwatch.ops.autoload.worker_setup")
            kwargs["runtime_env"] = runtime_env
        except Exception as exc:  # noqa: BLE001
            logger.warning("rlwatch: could not extend ray.init's runtime_env: %s", exc)
        return original(*args, **kwargs)

    init.__rlwatch_original__ = original
    module.init = init


def worker_setup() -> None:
    """Ray's worker_process_setup_hook: the same lazy hooks inside every Ray worker."""
    initialize()


def initialize() -> None:
    """Install the post-import hooks (idempotent). Called by the bootstrap sitecustomize."""
    global _initialized
    with _lock:
        if _initialized:
            return
        _initialized = True
    wanted = config.frameworks(list(FRAMEWORK_SETUP))
    from . import distribution
    from ..integrations._instrumentor import installed_version

    if distribution.foreign_files():                  # a few stat calls: this runs in every process
        print(f"rlwatch: {distribution.conflict_message(distribution.foreign_rlwatch())}", file=sys.stderr,
              flush=True)
    for name, setup in FRAMEWORK_SETUP.items():
        if config.run_report_path():
            on_import(name, _note_import(name))
        if name in wanted and installed_version(name) is not None:
            try:
                setup()
            except Exception as exc:  # noqa: BLE001 - a missing integration never stops the program
                logger.debug("rlwatch: %s integration not set up: %s", name, exc)
    on_import("ray", _hook_ray)
