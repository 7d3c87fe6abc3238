"""The user's signal thresholds: :class:`SignalConfig`, one keyword per declared threshold (apart from
:mod:`.settings`, which the engine's lower modules read: the declaration it validates against is above them)."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

from .quantities import threshold_values


class SignalConfig:
    """Thresholds the signals are computed against (read-only).

    One keyword per declared threshold (:data:`rlwatch.signals.quantities.SIGNAL_THRESHOLDS`, each with
    its default and meaning, the runbook's "Signal settings"): ``staleness_bound`` (lag above which a token
    counts as over-stale, default 4), ``is_cap`` (the truncated-IS cap C, default 2), ``mis_band`` (the
    masked-IS band [low, high], default (0.5, 5)), ...; a value outside the threshold's range raises
    ValueError, an unknown keyword TypeError. And:

    reward_bounds: (fail, pass) rewards that classify constant groups; inferred per batch if None.
    group_size: expected episodes per group (e.g. num_generations), checked when given.
    """

    def __init__(self, *, reward_bounds: tuple[float, float] | None = None, group_size: int | None = None,
                 **thresholds: Any) -> None:
        for name, value in {**threshold_values(thresholds), "reward_bounds": reward_bounds,
                            "group_size": group_size}.items():
            object.__setattr__(self, name, value)

    @property
    def thresholds(self) -> dict[str, Any]:
        """The declared thresholds' values by name, in declaration order."""
        return {k: v for k, v in self.__dict__.items() if k not in ("reward_bounds", "group_size")}

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __hash__(self) -> int:
        return hash(tuple(self.__dict__.items()))

    def __repr__(self) -> str:
        return f"SignalConfig({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"
