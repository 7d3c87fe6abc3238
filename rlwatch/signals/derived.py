"""Values derived from other values of the step, shared by the signals and the step pipeline."""

from __future__ import annotations

from typing import Any


def derive_hack_ratios(values: dict[str, dict[tuple[str, ...], Any]]) -> None:
    """``env_hack_ratio`` = episodes hacked / episodes judged, per environment and detector, from the
    two counters' increments in ``values`` (None when nothing was judged); its one definition.

    The signals call it on the step's own ``hacked`` flags (so ``rlwatch.compute`` returns it), and
    the step pipeline again once the detectors' verdicts are merged into the same counters."""
    judged = values.get("episodes_judged_total")
    if not judged:
        return
    hacked = values.get("episodes_hacked_total") or {}
    values["env_hack_ratio"] = {labels: ((hacked.get(labels) or 0.0) / n if n else None)
                                for labels, n in judged.items()}
