"""The step windows' view of a run: the last steps' values and the thresholds in force.

A condition (:mod:`rlwatch.alerts.conditions`, the domain modules) reads one :class:`History` per
step and returns its :data:`Verdicts`.
"""

from __future__ import annotations

import math

LabelSet = dict[str, str]
#: One alert's reading of one step: {label values: (value, raise, hold)}.
Verdicts = dict[tuple[str, ...], tuple[float, bool, bool]]


class History:
    """The last steps' values ({metric name: {label values: value}}) and the thresholds in force."""

    def __init__(self, steps: list[tuple[int, dict]], params: dict[str, float], memory: dict | None = None) -> None:
        self.steps = steps
        self.params = params
        self.memory: dict = {} if memory is None else memory    # state a condition keeps across steps
        self.stats: dict[tuple[str, str], float] = {}     # (kind, signal) -> window statistic, exported

    def p(self, name: str) -> float:
        """The threshold ``name`` in force: ``params`` holds every one (``params.thresholds(overrides)``)."""
        try:
            return self.params[name]
        except KeyError:
            raise KeyError(f"threshold {name!r} is not in this History's params: build it with "
                           f"rlwatch.alerts.params.thresholds(overrides)") from None

    @property
    def step(self) -> int | None:
        return self.steps[-1][0] if self.steps else None

    def latest(self, name: str, labels: tuple[str, ...] = ()) -> float | None:
        if not self.steps:
            return None
        v = self.steps[-1][1].get(name, {}).get(labels)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v

    def family(self, name: str) -> dict[tuple[str, ...], float]:
        if not self.steps:
            return {}
        return {k: v for k, v in self.steps[-1][1].get(name, {}).items() if v is not None and v == v}

    def window(self, name: str, labels: tuple[str, ...], last: int, skip: int = 0) -> list[float]:
        """Values of one series over the ``last`` steps that end ``skip`` steps before the latest."""
        end = len(self.steps) - skip
        chosen = self.steps[max(0, end - last):max(0, end)]
        return [v for _, values in chosen if (v := values.get(name, {}).get(labels)) is not None and v == v]

    def increments(self, name: str, last: int, skip: int = 0) -> dict[tuple[str, ...], float]:
        """Counter increments summed per label set over the ``last`` steps ending ``skip`` before the latest."""
        end = len(self.steps) - skip
        out: dict[tuple[str, ...], float] = {}
        for _, values in self.steps[max(0, end - last):max(0, end)]:
            for labels, v in values.get(name, {}).items():
                if v:
                    out[labels] = out.get(labels, 0.0) + v
        return out

    def steps_with(self, name: str, labels: tuple[str, ...], last: int, skip: int = 0) -> int:
        end = len(self.steps) - skip
        return sum(1 for _, values in self.steps[max(0, end - last):max(0, end)] if values.get(name, {}).get(labels))


__all__ = ["History", "LabelSet", "Verdicts"]
