"""Pure per-step RL health signals computed from plain tensors.

Everything here runs on the tensors' own device, vectorised, and never synchronises with the host
before the step's single transfer (:meth:`Pending.resolve`). Nothing materialises a
``[batch, time, vocab]`` tensor and no Python loop runs over tokens.

One module per concern, in the order a step runs through them:

- :mod:`.settings`: the size limits, the engine's plan for a device, the :class:`Workspace`;
  :mod:`.signal_config`: :class:`SignalConfig`, the user's thresholds.
- :mod:`.quantities`: every token-, sequence- and episode-level quantity declared once, with its host
  formula.
- :mod:`.step`: :func:`compute_step`; it runs :func:`.fused.step_core` (built from
  the declaration, read through :mod:`.plans`; :mod:`.episodes` for the episode block) through
  :mod:`.engine` (compiled when ready).
- :mod:`.reduce`: the constant cache and integer counts; :mod:`.pending`: the one transfer and the
  NaN-to-None policy.

The size limits are read at call time from :mod:`.settings`: change
``rlwatch.signals.settings.EXACT_QUANTILE_MAX_TOKENS`` (not a copy here).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Pending", "SignalConfig", "Values", "Workspace", "compute_step"]

# Loaded on first use: the catalogue imports the buckets and labels (.buckets) in processes that must not
# import torch (a Ray worker's setup hook).
_LAZY = {"Pending": ".pending", "Values": ".pending", "SignalConfig": ".signal_config", "Workspace": ".settings",
         "compute_step": ".step"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
