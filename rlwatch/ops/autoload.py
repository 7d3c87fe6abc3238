"""Zero-code instrumentation: what ``rlwatch run -- <command>`` installs in every Python process.

``rlwatch run`` puts ``rlwatch/_bootstrap`` first on ``PYTHONPATH``; its ``sitecustomize`` calls
:func:`initialize`, which sets up every registered integration whose framework is installed (each
declares an ``Autoload`` in its own package, found without a central list:
:mod:`rlwatch.integrations.registry`); each setup is lazy: when the training program imports a
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
from ..integrations import registry

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

def _note_import(framework: str) -> Callable[[Any], None]:
    def hook(module: Any) -> None:
        from ..integrations._instrumentor import installed_version

        report("imported", framework=framework, version=installed_version(framework))
    return hook


# --- what is hooked -------------------------------------------------------------------------------

def frameworks() -> list[str]:
    """The frameworks ``rlwatch run`` instruments by default (every registered integration, in order)."""
    return registry.names()


def _set_up(name: str) -> None:
    """Run the registration of ``name`` (at once, or when its ``on_import`` module is imported)."""
    autoload = registry.registration(name)
    if autoload.on_import:
        on_import(autoload.on_import, autoload.setup)
    else:
        autoload.setup()


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
    names = frameworks()
    wanted = config.frameworks(names)
    from . import distribution
    from ..integrations._instrumentor import installed_version

    if distribution.foreign_files():                  # a few stat calls: this runs in every process
        print(f"rlwatch: {distribution.conflict_message(distribution.foreign_rlwatch())}", file=sys.stderr,
              flush=True)
    for name in names:
        if config.run_report_path():
            on_import(name, _note_import(name))
        if name in wanted and installed_version(name) is not None:
            try:
                _set_up(name)
            except Exception as exc:  # noqa: BLE001 - a missing integration never stops the program
                logger.debug("rlwatch: %s integration not set up: %s", name, exc)
    on_import("ray", _hook_ray)
