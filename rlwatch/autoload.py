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
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("rlwatch")

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "_bootstrap")
_initialized = False
_hooks: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.RLock()


def watch_options_from_env() -> dict[str, Any]:
    """Watch keyword arguments configured through RLWATCH_* variables."""
    options: dict[str, Any] = {}
    if os.environ.get("RLWATCH_RUN"):
        options["run"] = os.environ["RLWATCH_RUN"]
    port = os.environ.get("RLWATCH_PORT")
    if port is not None:
        options["port"] = None if port.lower() in ("", "none", "off") else int(port)
    if os.environ.get("RLWATCH_ADDR"):
        options["addr"] = os.environ["RLWATCH_ADDR"]
    if os.environ.get("RLWATCH_STORE"):
        options["store"] = os.environ["RLWATCH_STORE"]
    if os.environ.get("RLWATCH_STRICT") == "1":
        options["strict"] = True
    options.setdefault("port_fallback", True)
    return options


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a watched module so a hook runs after it loads."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _hooks:
            return None
        sys.meta_path.remove(self)               # find the real spec without recursing into ourselves
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_hook(module: Any) -> None:
            exec_module(module)
            _run_hooks(fullname, module)

        spec.loader = _LoaderProxy(loader, exec_and_hook)
        return spec


class _LoaderProxy(importlib.abc.Loader):
    def __init__(self, loader: Any, exec_module: Callable[[Any], None]) -> None:
        self._loader = loader
        self._exec = exec_module

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._exec(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _run_hooks(name: str, module: Any) -> None:
    with _lock:
        hooks = _hooks.pop(name, [])
    for hook in hooks:
        try:
            hook(module)
        except Exception as exc:  # noqa: BLE001 - never break the user's import
            logger.warning("rlwatch: hook on import of %s failed: %s", name, exc)


def on_import(module_name: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (at once if it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _hooks.setdefault(module_name, []).append(hook)
            if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
                sys.meta_path.insert(0, _PostImportFinder())
            return
    hook(module)


# --- what is hooked -------------------------------------------------------------------------------

def _hook_trl(module: Any) -> None:
    from .integrations import trl as integration

    integration.autoinstrument(watch_options_from_env())


def _hook_verl(module: Any) -> None:
    from .integrations import verl as integration

    integration.autoinstrument(watch_options_from_env())


def _hook_openrlhf(module: Any) -> None:
    from .integrations import openrlhf as integration

    integration.autoinstrument(watch_options_from_env())


FRAMEWORK_HOOKS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "trl": ("trl.trainer.grpo_trainer", _hook_trl),
    "verl": ("verl.trainer.ppo.metric_utils", _hook_verl),
    "openrlhf": ("openrlhf.trainer.ppo_utils.experience_maker", _hook_openrlhf),
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
            for key, value in os.environ.items():
                if key.startswith("RLWATCH_"):
                    env_vars.setdefault(key, value)
            paths = [BOOTSTRAP_DIR] + [p for p in env_vars.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
                                       .split(os.pathsep) if p and p != BOOTSTRAP_DIR]
            env_vars["PYTHONPATH"] = os.pathsep.join(paths)
            runtime_env["env_vars"] = env_vars
            runtime_env.setdefault("worker_process_setup_hook", "rlwatch.autoload.worker_setup")
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
    wanted = {f.strip() for f in os.environ.get("RLWATCH_FRAMEWORKS", ",".join(FRAMEWORK_HOOKS)).split(",") if f}
    for name, (module_name, hook) in FRAMEWORK_HOOKS.items():
        if name in wanted:
            on_import(module_name, hook)
    on_import("ray", _hook_ray)
