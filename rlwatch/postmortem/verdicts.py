"""The reward-hack counts of a run store, step by step as the episodes came.

A detector's verdicts reach the Watch later than the step whose episodes it judged (how much later
depends on the machine's load), so the step rows hold them under whichever step collected them. The
store's ``hack_counts`` table keeps them under the step the episodes came from; where a run has such
rows, they replace the step rows' ``episodes_judged_total`` / ``episodes_hacked_total`` and
``env_hack_ratio`` is derived again from them, step by step.
"""

from __future__ import annotations

from typing import Any, Callable

from ..core.values import Values
from ..signals.derived import derive_hack_ratios

#: The families the hack counts replace in each step's values.
HACK_FAMILIES = ("episodes_judged_total", "episodes_hacked_total", "env_hack_ratio")


def read_hack_counts(store: Any, run: str, note: Callable[[str], None]) -> dict[int, Values]:
    """{source step: {"episodes_judged_total": {(env, detector): n}, "episodes_hacked_total": {...}}}."""
    out: dict[int, Values] = {}
    for row in store._rows("SELECT step, env, detector, judged, hacked FROM hack_counts WHERE run = ?", (run,)):
        try:
            step, key = int(row["step"]), (str(row["env"]), str(row["detector"]))
            judged, hacked = float(row["judged"] or 0.0), float(row["hacked"] or 0.0)
        except (TypeError, ValueError):
            note("malformed hack count rows")
            continue
        values = out.setdefault(step, {"episodes_judged_total": {}, "episodes_hacked_total": {}})
        values["episodes_judged_total"][key] = values["episodes_judged_total"].get(key, 0.0) + judged
        values["episodes_hacked_total"][key] = values["episodes_hacked_total"].get(key, 0.0) + hacked
    return out


def apply_hack_counts(steps: list[tuple[int, Values]], counts: dict[int, Values]) -> None:
    """Put each step's own hack counts (``counts``, by source step) in its values, in place, and derive
    ``env_hack_ratio`` from them; nothing changes when ``counts`` is empty (a store without the table)."""
    if not counts:
        return
    for step, values in steps:
        for family in HACK_FAMILIES:
            values.pop(family, None)
        own = counts.get(step)
        if own:
            values.update({family: dict(labels) for family, labels in own.items()})
            derive_hack_ratios(values)
