"""One step's values from two sources, joined: ``observe`` (rlwatch's own signals) and the trainer's
logged scalars (``Watch.log_scalars``, read through :func:`rlwatch.core.trainer_keys.recognise`).

TRL and verl log a step's metrics after that step was observed; a custom loop may log them before,
and a replayed log has no ``observe`` at all. Whichever arrives first is judged at once (so a run that
only logs scalars is judged step by step); when the other arrives for the same step, the step is
judged again on the union and that verdict replaces the first one (the alert windows roll the step
back, :meth:`rlwatch.alerts.windows.AlertWindows.rollback`; the store's row is replaced): one verdict
per step, no value lost. Where both sources give a signal, rlwatch's own value is kept.
"""

from __future__ import annotations

from ..core.values import ADDITIVE_KINDS, StepValues, kind_of

#: The families the alert windows produce for a step (judged again, they are produced again).
WINDOW_FAMILIES = frozenset({"alert_value", "alert_streak_steps", "alert_hit_steps", "alert_quiet_steps",
                             "alert_incident"})


def judged_afresh(values: StepValues) -> StepValues:
    """A copy of a step's values without what the alert windows added to them."""
    return StepValues({name: dict(family) for name, family in values.items()
                       if name not in WINDOW_FAMILIES and not name.startswith("window_")})


def gauges_only(values: StepValues) -> dict:
    """The step's values less its counter and histogram increments (already exported once)."""
    return {name: family for name, family in values.items() if kind_of(name) not in ADDITIVE_KINDS}


class StepJoin:
    """The latest judged step: its number, its values, the names ``observe`` gave and the trainer's."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.values: StepValues | None = None
        self.observed: frozenset[str] = frozenset()       # names from observe (they win)
        self.trainer: dict[str, float] = {}                # the trainer's recognised values of the step

    def pending_trainer(self, step: int) -> dict[str, float]:
        """The trainer's values logged for ``step`` before it was observed (empty otherwise)."""
        return dict(self.trainer) if self.step == step and not self.observed else {}

    def add_trainer(self, values: StepValues, trainer: dict[str, float]) -> None:
        """Put the trainer's values into ``values`` where ``observe`` gave none."""
        for name, value in trainer.items():
            if name not in self.observed:
                values[name] = {(): float(value)}

    def remember(self, step: int, values: StepValues, observed: frozenset[str] | None,
                 trainer: dict[str, float]) -> None:
        if self.step != step:
            self.observed, self.trainer = frozenset(), {}
        self.step, self.values = step, values
        if observed is not None:
            self.observed = observed
        self.trainer = {**self.trainer, **trainer}


__all__ = ["StepJoin", "WINDOW_FAMILIES", "gauges_only", "judged_afresh"]
