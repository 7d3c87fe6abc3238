"""The alert catalogue's domains, one module each. A domain module declares its alerts in
``ALERTS`` (a tuple, in page order) and the thresholds only its alerts read in ``PARAMS``
({name: :class:`~rlwatch.alerts.model.Param`}); :mod:`rlwatch.alerts.catalogue` and
:mod:`rlwatch.alerts.params` collect them from :func:`modules`, so an alert and its threshold are
added in their domain module alone.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

#: The domains in the order of the rules and the runbook; a module of this package not named here
#: follows them, by name.
ORDER = ("mismatch", "staleness", "importance", "data", "hacks", "distribution", "rollout", "liveness")


def names() -> list[str]:
    """The domain modules of this package (every path entry of it), in :data:`ORDER`, then by name."""
    found = {info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")}
    return [name for name in ORDER if name in found] + sorted(found - set(ORDER))


def modules() -> list[ModuleType]:
    """The domain modules, imported, in :func:`names` order."""
    return [importlib.import_module(f"{__name__}.{name}") for name in names()]


__all__ = ["ORDER", "modules", "names"]
