"""Pure per-step RL health signals computed from plain tensors.

Everything here runs on the tensors' own device, vectorised, and never synchronises with the host:
each signal function puts 0-d or small 1-d tensors into a :class:`Pending` collection, and
:meth:`Pending.resolve` moves all of them to the host in a single transfer. Nothing materialises
a ``[batch, time, vocab]`` tensor and no Python loop runs over tokens.

One module per concern, in the order a step runs through them:

- :mod:`.settings`: :class:`SignalConfig`, the size limits choosing a path, the :class:`Workspace`.
- :mod:`.pending`: :class:`Pending` (the one transfer) and the NaN-to-None policy.
- :mod:`.reduce`: small device reductions (quantiles, bin counts, dot products).
- :mod:`.step`: :func:`compute_step` / :func:`compute`, and the token signals' choice between
  the fused engine (:mod:`.fused`, :mod:`.engine`) and the in-place path:
- :mod:`.mismatch`: mismatch and importance sampling; :mod:`.lag`: version lag;
- :mod:`.episodes`: every episode signal as one pure function (rewards, groups, lengths,
  truncation, per environment), run with the token signals by :func:`.fused.step_core`;
- :mod:`.groups`, :mod:`.environments`: the same signals one function each (kept as the reference
  the episode function is tested against), entropy, failures by kind.

This module only re-exports the names other code imports. The size limits are read at call time
from :mod:`.settings`: change ``rlwatch.signals.settings.EXACT_QUANTILE_MAX_TOKENS`` (not a copy here).
"""

from __future__ import annotations

from . import engine, episodes, fused
from .environments import env_signals, failure_counts
from .groups import entropy_signal, group_index, group_signals, length_signals, reward_signals
from .lag import lag_signals, put_lag_histogram, token_lag_counts
from .mismatch import importance_ratio_signals, mismatch_signals
from .pending import Pending, Values
from .reduce import bin_counts, masked_quantiles, quantile_from_counts
from .settings import SAFETY_BOUND, SignalConfig, Workspace
from .step import compute, compute_step, token_signals

__all__ = [
    "SAFETY_BOUND", "Pending", "SignalConfig", "Values",
    "Workspace", "bin_counts", "compute", "compute_step", "engine", "episodes", "entropy_signal", "env_signals",
    "failure_counts", "fused", "group_index", "group_signals", "importance_ratio_signals", "lag_signals",
    "length_signals", "masked_quantiles", "mismatch_signals", "put_lag_histogram", "quantile_from_counts",
    "reward_signals", "token_lag_counts", "token_signals",
]
