"""Every token-, sequence- and episode-level quantity of a step, and every threshold they are computed
against, declared once, by level:

- :mod:`.tokens`: the per-token terms (:data:`TERMS`), the sums over the valid tokens
  (:data:`TOKEN_SUMS`), the configurable thresholds (:data:`SIGNAL_THRESHOLDS`) and the token- and
  sequence-level families with their host formulas (:data:`METRICS`);
- :mod:`.sequences`: the sums over the sequences (:data:`SEQ_SUMS`);
- :mod:`.episodes`: the per-episode rows (:data:`EPISODE_ROWS`) and the episode families
  (:data:`EPISODE_METRICS`); :mod:`.groups`: the rows of one value per GRPO group (:data:`GROUP_ROWS`);
- :mod:`.declare`: the kinds of declaration (:class:`TokenSum`, :class:`SeqSum`, :class:`Metric`,
  :class:`EpisodeRow`, :class:`GroupRow`, :class:`Threshold`);
- :mod:`.readers`: what a step makes of them (the vector's layout, the device constants, the host formulas).

:mod:`rlwatch.signals.fused` builds its device work from :data:`TOKEN_SUMS` and :data:`SEQ_SUMS` (eagerly as
a few stacked [k, B, T] groups reduced at once, compiled as one reduction per sum) and packs the results
in the order :func:`token_fields` gives; :func:`finish_tokens` applies :data:`METRICS` to the transferred
vector. :mod:`rlwatch.signals.episodes` stacks :data:`EPISODE_ROWS` and :data:`GROUP_ROWS` in the order
:func:`episode_layout` gives; :func:`finish_episodes` applies :data:`EPISODE_METRICS`. A threshold's
declaration reaches SignalConfig, WatchConfig and Watch (a keyword), the environment (``RLWATCH_<NAME>``),
the catalogue and the exposition (a config gauge) and the runbook ("Signal settings").

Everything that reads the declarations reads them here (``quantities.TOKEN_SUMS``, ...), so that a test
may declare more by replacing them (``tests/test_declared_signal.py``). Adding a quantity:
``docs/adding-a-signal.md``.
"""

from __future__ import annotations

from .declare import BY_LABEL_NAMES, BY_LABELS, EpisodeRow, GroupRow, Metric, SeqSum, Threshold, TokenSum, _needed
from .tokens import (LAG_FIELDS, METRICS, MISMATCH_TAIL, SIGNAL_THRESHOLDS, TERMS, TOKEN_SUMS, ess_ratio,
                     slope)
from .sequences import SEQ_SUMS
from .episodes import EPISODE_METRICS, EPISODE_ROWS, LENGTH_QUANTILE, LENGTH_QUANTILES
from .groups import GROUP_ROWS, GROUP_THRESHOLDS
from .readers import (_apply, _metrics, device_constants, episode_layout, episode_rows, fields, finish_episodes,
                    finish_tokens, group_block, threshold_names, threshold_values, token_fields, token_sums)

__all__ = ["BY_LABELS", "BY_LABEL_NAMES", "EPISODE_METRICS", "EPISODE_ROWS", "EpisodeRow", "GROUP_ROWS",
           "GROUP_THRESHOLDS", "GroupRow", "LAG_FIELDS", "LENGTH_QUANTILE", "LENGTH_QUANTILES",
           "METRICS", "MISMATCH_TAIL", "Metric",
           "SEQ_SUMS", "SIGNAL_THRESHOLDS", "SeqSum", "TERMS", "TOKEN_SUMS", "Threshold", "TokenSum",
           "device_constants", "episode_layout", "episode_rows", "ess_ratio", "fields", "finish_episodes",
           "finish_tokens", "group_block", "slope", "threshold_names", "threshold_values", "token_fields",
           "token_sums", "_apply", "_metrics", "_needed"]
