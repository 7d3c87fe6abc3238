"""The values a threshold may take, one rule for the signals' thresholds
(:class:`rlwatch.signals.quantities.Threshold`) and the alerts' (:class:`rlwatch.alerts.model.Param`)."""

from __future__ import annotations

import math


class Ranged:
    """A mixin for a declaration with ``low``, ``high``, ``above`` and ``below``: the values allowed run from
    ``low`` (or strictly above ``above`` when set) to ``high`` (or strictly below ``below`` when set), finite."""

    low: float
    high: float
    above: float | None
    below: float | None

    @property
    def allowed(self) -> str:
        """The allowed range in interval notation, e.g. ``(0, inf)`` or ``[0, 1]``."""
        left = f"({self.above:g}" if self.above is not None else f"[{self.low:g}"
        right = (f"{self.below:g})" if self.below is not None
                 else f"{self.high:g}{')' if math.isinf(self.high) else ']'}")
        return f"{left}, {right}"

    def allows(self, value: float) -> bool:
        floor_ok = value > self.above if self.above is not None else value >= self.low
        ceiling_ok = value < self.below if self.below is not None else value <= self.high
        return math.isfinite(value) and floor_ok and ceiling_ok
