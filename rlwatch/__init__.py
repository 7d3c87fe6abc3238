"""rlwatch: per-token health signals for RL post-training of language models.

Quick start::

    import rlwatch
    with rlwatch.Watch(run="my-run") as watch:
        for step, batch in enumerate(loader):
            ...
            watch.observe(step, mask=mask, sampler_logp=mu_logp, trainer_logp=old_logp,
                          token_version=versions, trainer_version=step, rewards=rewards, group_ids=uids)

Importing the package is cheap: torch and the exporters load on first use of ``Watch``,
``compute`` or ``SignalConfig`` (the zero-code bootstrap imports rlwatch in every process).

The distribution is ``rlwatch-llm`` (installed from a clone or its wheel: README.md); the import name is ``rlwatch``.
"""

from typing import Any

from ._version import __version__
from .core.errors import InvalidFieldError, PortInUseError, RLWatchError

__all__ = ["Watch", "WatchConfig", "SignalConfig", "StepFields", "StepValues", "StoreReader", "compute",
           "InvalidFieldError", "PortInUseError", "RLWatchError", "__version__"]

_LAZY = {"Watch": ("hook.watch", "Watch"), "WatchConfig": ("core.config", "WatchConfig"),
         "SignalConfig": ("signals", "SignalConfig"), "StepFields": ("core.fields", "StepFields"),
         "StepValues": ("core.values", "StepValues"), "StoreReader": ("runs.store_reader", "StoreReader"),
         "compute": ("hook.compute", "compute")}
_LAZY_MODULES = {"hacks"}          # ``rlwatch.hacks.detector`` after a plain ``import rlwatch``


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlwatch' has no attribute {name!r}")


def _warn_if_shadowed() -> None:
    """The unrelated PyPI project "rlwatch" installs into this same directory (see
    ``rlwatch.ops.distribution``): say so once, with the fix, instead of failing obscurely later."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    if any(os.path.exists(os.path.join(here, name)) for name in ("core.py", "detectors.py")):
        import warnings

        from .ops.distribution import conflict_message, foreign_rlwatch

        warnings.warn(conflict_message(foreign_rlwatch()), RuntimeWarning, stacklevel=2)


_warn_if_shadowed()
