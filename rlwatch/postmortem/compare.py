"""How a bad run diverged from a good one: both aligned by step, the CUSUM of
:mod:`rlwatch.postmortem.changes` run on the per-step difference bad - good, with reference 0."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from .changes import (COMPARE_CONFIRM, COMPARE_H, CONFIRM_STEPS, QUALITY_SPEC, REFERENCE_POINTS, SignalSpec,
                      _clean_zero, _finite, _label_name, detect_change, scanned_series)
from .sources import QUALITY_KEYS, RunData


@dataclass
class Divergence:
    """Where ``signal`` in the bad run left the good run's: dated at ``step``, confirmed at ``alarm_step``."""

    signal: str
    labels: tuple[str, ...]
    step: int
    alarm_step: int
    difference: float     # bad - good, the level after the divergence
    noise: float
    bad: float            # the bad run's median over ``window``, after the divergence
    good: float           # the good run's median over the same steps
    window: tuple[int, int] = (0, 0)   # first and last step of those medians

    @property
    def name(self) -> str:
        return _label_name(self.signal, self.labels)

    @property
    def size(self) -> float:
        return self.difference / self.noise if self.noise > 0 else math.inf

    def as_json(self) -> dict[str, Any]:
        return {"signal": self.name, "step": self.step, "alarm_step": self.alarm_step,
                "difference": _clean_zero(self.difference), "size": _finite(self.size), "noise": self.noise,
                "bad": _clean_zero(self.bad), "good": _clean_zero(self.good), "window": list(self.window)}


@dataclass
class Comparison:
    bad: str
    good: str
    common_steps: tuple[int, int, int] | None       # first, last, count
    compared: list[str]
    divergences: list[Divergence]
    only_bad: list[str] = field(default_factory=list)
    only_good: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"bad": self.bad, "good": self.good,
                "common_steps": list(self.common_steps) if self.common_steps else None,
                "compared": self.compared, "divergences": [d.as_json() for d in self.divergences],
                "only_in_bad_run": self.only_bad, "only_in_good_run": self.only_good}


def _compared_series(data: RunData) -> dict[tuple[str, tuple[str, ...]], tuple[SignalSpec, list[tuple[int, float]]]]:
    out = {(name, labels): (spec, series) for name, labels, spec, series in scanned_series(data) if spec.compared}
    for key in QUALITY_KEYS:
        if data.scalars.get(key):
            out[(key, ())] = (QUALITY_SPEC, sorted(data.scalars[key]))
    return out


def compare(bad: RunData, good: RunData) -> Comparison:
    """Align two runs by step and find where each signal of ``bad`` first diverged from ``good``:
    the same CUSUM on the per-step difference bad - good, with reference 0 (runs that agree)."""
    a, b = _compared_series(bad), _compared_series(good)
    common_steps = sorted({s for s, _ in bad.steps} & {s for s, _ in good.steps}
                          | ({s for pts in (x[1] for x in a.values()) for s, _ in pts}
                             & {s for pts in (x[1] for x in b.values()) for s, _ in pts}))
    divergences, compared = [], []
    for key in sorted(set(a) & set(b)):
        spec, bad_series = a[key]
        good_at = dict(b[key][1])
        pairs = [(s, v, good_at[s]) for s, v in bad_series if s in good_at]
        if len(pairs) < REFERENCE_POINTS + 2:
            continue
        compared.append(_label_name(*key))
        floor = spec.floor([y for _, _, y in pairs])             # the good run sets the scale
        found = detect_change([(s, x - y) for s, x, y in pairs], floor, reference=0.0, h=COMPARE_H,
                              confirm=COMPARE_CONFIRM)
        if found is None:
            continue
        step, alarm, _, difference, sigma = found
        window = [(s, x, y) for s, x, y in pairs if alarm <= s <= alarm + CONFIRM_STEPS]
        divergences.append(Divergence(key[0], key[1], step, alarm, difference, sigma,
                                      statistics.median(x for _, x, _ in window),
                                      statistics.median(y for _, _, y in window), (window[0][0], window[-1][0])))
    divergences.sort(key=lambda d: (d.step, -abs(d.size)))
    span = (common_steps[0], common_steps[-1], len(common_steps)) if common_steps else None
    return Comparison(bad=f"{bad.run} ({bad.source})", good=f"{good.run} ({good.source})", common_steps=span,
                      compared=compared, divergences=divergences,
                      only_bad=sorted(_label_name(*k) for k in set(a) - set(b)),
                      only_good=sorted(_label_name(*k) for k in set(b) - set(a)))
