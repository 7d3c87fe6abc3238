"""The headline signals, mirrored into the trainer's own logs under an ``rlwatch/`` prefix: which
logs each integration adds them to, the keys, ``RLWATCH_TRAINER_LOGS`` and which step's values they
are: README, "Where the signals go" ("The trainer's own logs"). A key is absent while its signal is.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..core.config import trainer_logs_enabled
from ._instrumentor import Call, guarded

PREFIX = "rlwatch/"

#: (key after the prefix, gauge in rlwatch.core.metrics, its label values)
HEADLINE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("kl_k3", "mismatch_kl_k3", ()),
    ("abs_log_ratio_p99", "mismatch_abs_log_ratio_p99", ()),
    ("is_ess", "is_ess_ratio", ()),
    ("is_tis_truncated_frac", "is_tis_high_ratio", ()),
    ("version_lag_max", "version_lag_max", ()),
    ("version_lag_over_bound_frac", "version_lag_over_bound_ratio", ()),
    ("zero_variance_all_pass_frac", "zero_variance_groups_ratio", ("all_pass",)),
    ("zero_variance_all_fail_frac", "zero_variance_groups_ratio", ("all_fail",)),
)
ALERTS_KEY = PREFIX + "alerts_firing"
KEYS = frozenset([PREFIX + key for key, _, _ in HEADLINE] + [ALERTS_KEY])


def headline(watch: Any) -> dict[str, float]:
    """``{"rlwatch/kl_k3": ..., ...}`` from the Watch's latest step; empty before the first step,
    on a Watch that exports nothing (not rank 0) and for None. ``rlwatch/alerts_firing`` counts the
    alerts the in-process evaluator has firing (present when alerts are on)."""
    if watch is None or not getattr(watch, "active", False):
        return {}
    snap = watch.state.snapshot()
    if snap.step is None:
        return {}
    out: dict[str, float] = {}
    for key, name, labels in HEADLINE:
        value = snap.gauges.get(name, {}).get(labels)
        if value is not None and math.isfinite(value):
            out[PREFIX + key] = float(value)
    evaluator = getattr(watch, "evaluator", None)
    if evaluator is not None:
        out[ALERTS_KEY] = float(len(evaluator.firing()))
    return out


def without_headline(logs: Mapping[str, Any]) -> dict[str, Any]:
    """``logs`` less the keys rlwatch added (so that they are not stored back as framework scalars)."""
    return {k: v for k, v in logs.items() if k not in KEYS}


def merged(logs: Any, watch: Any) -> Any:
    """``logs`` with the headline keys added (a new dict; ``logs`` itself when it is not a mapping,
    when mirroring is off or when there is nothing to add), appended after the framework's own
    keys, which win on a clash."""
    if not isinstance(logs, Mapping) or not trainer_logs_enabled():
        return logs
    extra = headline(watch)
    if not extra:
        return logs
    return {**logs, **{k: v for k, v in extra.items() if k not in logs}}


def mirror_call(call: Call, index: int, name: str, watch: Any, kind: str) -> None:
    """Pass the patched function the logs dict of argument ``index`` / ``name`` with the headline
    keys added (:func:`merged`, guarded under ``kind``), so that they reach the framework's own
    trackers; ``call.state`` keeps the framework's own dict."""
    logs = call.state = call.arg(index, name)
    mirrored = guarded(watch, kind)(merged)(logs, watch)
    if mirrored is not None and mirrored is not logs:
        call.replace_arg(index, name, mirrored)
