"""How an integration registers itself for ``rlwatch run`` (zero-code instrumentation), with no
central list: each integration declares an :class:`Autoload` in its own package and
:mod:`rlwatch.ops.autoload` finds it.

- A built-in integration is a subpackage of :mod:`rlwatch.integrations` whose ``AUTOLOAD`` is an
  :class:`Autoload`; :func:`names` finds the subpackages by iterating the package (no reinstall).
- A third-party integration registers through the entry-point group :data:`GROUP`
  (``rlwatch.integrations``), named after its framework, pointing at its ``Autoload`` or at a module
  that has one::

      [project.entry-points."rlwatch.integrations"]
      myframework = "rlwatch_myframework:AUTOLOAD"

A registration is loaded (its package imported) only in a process where its framework is installed
(``importlib.metadata``: a distribution of the framework's name) and selected (RLWATCH_FRAMEWORKS).
Importing this module and listing the names imports nothing from any integration or framework.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import pkgutil
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..core.run_report import report

logger = logging.getLogger("rlwatch")

#: The entry-point group third-party integrations register in.
GROUP = "rlwatch.integrations"
#: The built-in integrations in the order ``rlwatch run`` names and sets them up; any other one
#: follows: other subpackages, then entry points, by name.
ORDER = ("trl", "verl", "openrlhf")


@dataclass(frozen=True)
class Autoload:
    """What ``rlwatch run`` does for one framework in every Python process where it is installed.

    ``framework``: the name RLWATCH_FRAMEWORKS (``rlwatch run --frameworks``) selects, the
    distribution whose presence is checked and the module whose import is reported to ``rlwatch run``.
    ``setup``: called at start-up (``setup()``), or, when ``on_import`` names a module, once that module
    has been imported (``setup(module)``), before the importing statement binds anything from it. It
    must itself be lazy (an import hook, a patched constructor): it runs in every process."""

    framework: str
    setup: Callable[..., None]
    on_import: str = ""


def _builtin() -> set[str]:
    package = sys.modules[__name__.rpartition(".")[0]]
    return {info.name for info in pkgutil.iter_modules(package.__path__)
            if info.ispkg and not info.name.startswith("_")}


def _entry_points() -> dict[str, Any]:
    try:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}
    except Exception as exc:  # noqa: BLE001 - broken metadata never stops the program
        logger.debug("rlwatch: could not read the %s entry points: %s", GROUP, exc)
        return {}


def names() -> list[str]:
    """Every registered framework: the built-in subpackages (:data:`ORDER` first, then by name), then
    the entry points' names, by name (a built-in wins over an entry point of the same name). Imports nothing."""
    builtin = _builtin()
    plugged = set(_entry_points()) - builtin
    return [n for n in ORDER if n in builtin] + sorted(builtin - set(ORDER)) + sorted(plugged)


def registration(name: str) -> Autoload:
    """The :class:`Autoload` of framework ``name``: ``rlwatch.integrations.<name>.AUTOLOAD``, else the
    entry point's object (an Autoload, or a module with an ``AUTOLOAD``). Imports that integration.
    Raises LookupError when there is none, TypeError when it is not an Autoload of that name."""
    if name in _builtin():
        found: Any = importlib.import_module(f"{__name__.rpartition('.')[0]}.{name}")
    elif name in (eps := _entry_points()):
        found = eps[name].load()
    else:
        raise LookupError(f"no rlwatch integration registered for {name!r}")
    found = getattr(found, "AUTOLOAD", found)
    if not isinstance(found, Autoload) or found.framework != name:
        raise TypeError(f"the rlwatch integration registered for {name!r} is not an Autoload(framework={name!r}): "
                        f"{found!r}")
    return found


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


def announce_created_watches(instrumentor: Any, framework: str) -> None:
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


__all__ = ["GROUP", "ORDER", "Autoload", "announce", "announce_created_watches", "names", "registration"]
