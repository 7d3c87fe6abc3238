"""Baseline-relative drift detection on the per-step signals.

Fixed thresholds miss a signal that climbs slowly from a run-specific baseline. For each watched
series, a one-sided CUSUM accumulates robust z-scores against a trailing baseline (median and MAD
of the ``window`` steps that end ``gap`` steps ago): ``S <- max(0, S + z - k)``. The score S is
exported as ``rlwatch_drift_score{signal, env, detector}`` and read by the alert catalogue.

Warm-up: no score until ``warmup`` steps of the series exist, so nothing fires on step 3.
Cool-down: the baseline keeps moving, so a new level becomes the baseline and S decays by ``k``
per step; S is capped at ``cap`` so that the decay after a long drift is bounded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Mapping

from ..core.values import Values

#: series watched: name -> (direction, absolute floor of the scale). "up" scores increases.
SIGNALS: dict[str, tuple[str, float]] = {
    "mismatch_kl_k3": ("up", 1e-3),
    "mismatch_abs_log_ratio_p99": ("up", 0.02),
    "is_ess_ratio": ("down", 0.02),
    "entropy_mean": ("down", 0.02),
    "env_hack_ratio": ("up", 0.05),
    "env_reward_length_corr": ("up", 0.1),
}


@dataclass(frozen=True)
class DriftConfig:
    warmup: int = 15
    window: int = 40
    gap: int = 3
    k: float = 0.5
    relative_floor: float = 0.05   # the scale is at least this fraction of |median|
    cap: float = 40.0


class _Series:
    def __init__(self, config: DriftConfig) -> None:
        self.values: deque = deque(maxlen=config.window + config.gap)
        self.score = 0.0
        self.seen = 0


class DriftDetector:
    """A ``Watch`` listener that adds ``drift_score`` values to each step."""

    def __init__(self, config: DriftConfig | None = None, signals: dict[str, tuple[str, float]] | None = None):
        self.config = config or DriftConfig()
        self.signals = SIGNALS if signals is None else signals
        self._series: dict[tuple[str, tuple[str, ...]], _Series] = {}

    def _update(self, key: tuple[str, tuple[str, ...]], x: float, direction: str, floor: float) -> float | None:
        cfg = self.config
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(cfg)
        score = None
        baseline = list(series.values)[: max(0, len(series.values) - cfg.gap)]
        if series.seen >= cfg.warmup and len(baseline) >= cfg.warmup - cfg.gap:
            med = median(baseline)
            mad = median(abs(v - med) for v in baseline)
            scale = max(1.4826 * mad, cfg.relative_floor * abs(med), floor)
            z = (x - med) / scale if direction == "up" else (med - x) / scale
            series.score = min(cfg.cap, max(0.0, series.score + z - cfg.k))
            score = series.score
        series.values.append(x)
        series.seen += 1
        return score

    def on_step(self, step: int, values: Mapping) -> Values | None:
        scores: dict[tuple[str, ...], float] = {}
        for name, (direction, floor) in self.signals.items():
            for labels, x in values.get(name, {}).items():
                if x is None:
                    continue
                if name == "env_hack_ratio":
                    env, detector = labels
                    out_labels = (name, env, detector)
                elif name == "env_reward_length_corr":
                    out_labels = (name, labels[0], "")
                else:
                    out_labels = (name, "", "")
                score = self._update((name, labels), x, direction, floor)
                if score is not None:
                    scores[out_labels] = score
        return {"drift_score": scores} if scores else None

    def close(self) -> None:
        pass
