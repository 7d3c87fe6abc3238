"""A scale-free critical condition tried on the scenario matrix, not shipped: k3 divided by the
policy's mean token entropy (prime-rl exports a KL/entropy ratio), opened as RLWatchKLSpike is.

One default of it would serve a toy policy and a language model alike if its healthy runs stayed
below a bound that still means trouble on a large model; :mod:`evaluation.acceptance` reports
its figures on both splits at each of :data:`RATIO_BOUNDS`.
"""

from __future__ import annotations

import statistics


#: Bounds tried for the scale-free trial: k3 / mean token entropy (prime-rl exports a KL/entropy ratio).
RATIO_BOUNDS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0)


def ratio_openings(trace: dict, bound: float, overrides: dict[str, float]) -> list[int]:
    """Steps at which a critical "k3 / entropy above ``bound``" alert (opened as RLWatchKLSpike is:
    2 steps running or the intermittent window, held above hold_fraction x the bound) would open."""
    from rlwatch.alerts.conditions import one
    from rlwatch.alerts.model import Alert, Runbook
    from rlwatch.alerts.windows import AlertWindows

    def condition(h):
        k3, entropy = h.latest("mismatch_kl_k3"), h.latest("entropy_mean")
        ratio = None if k3 is None or not entropy else k3 / entropy
        return one(ratio, ratio is not None and ratio > bound,
                   ratio is not None and ratio > h.p("hold_fraction") * bound)

    alert = Alert(name="KLEntropyRatio", severity="critical", summary="", description="", windows="",
                  runbook=Runbook("", [], [], []), condition=condition, for_steps=2, intermittent=True)
    windows = AlertWindows({k: v for k, v in overrides.items() if k.startswith(("intermittent", "hold", "clear"))},
                           alerts=[alert])
    opened, was_open = [], False
    for step, raw in trace["steps"]:
        is_open = bool(windows.on_step(step, raw)["alert_quiet_steps"])
        if is_open and not was_open:
            opened.append(step)
        was_open = is_open
    return opened


def ratio_trial(traces: list[dict], bound: float, overrides: dict[str, float], within: int = 10) -> dict[str, object]:
    """The bars' measures for the scale-free candidate at ``bound`` over ``traces`` (an intermittent
    fault counts when it opens within ``within`` steps of its first faulty step)."""
    from rlwatch.demo.config import ScenarioConfig
    from rlwatch.demo.scenario import collapse_step

    row: dict[str, object] = {"k3/entropy bound": bound, "healthy_critical_pages": 0, "collapsed": 0,
                              "collapsed_paged_before": 0, "intermittent_ok": 0, "intermittent_runs": 0}
    fractions = []
    for trace in traces:
        kind, opened = trace["spec"].kind, ratio_openings(trace, bound, overrides)
        collapse = collapse_step(trace["heldout"]) if trace["heldout"] else None
        if kind == "healthy":
            row["healthy_critical_pages"] += len(opened)
        elif kind == "collapse" and collapse:
            row["collapsed"] += 1
            if opened and opened[0] < collapse:
                row["collapsed_paged_before"] += 1
                fractions.append((collapse - opened[0]) / collapse)
        elif kind == "intermittent":
            row["intermittent_runs"] += 1
            start = ScenarioConfig.intermittent_from
            row["intermittent_ok"] += bool(opened) and 0 <= opened[0] - start < within
    row["lead_fraction_median"] = round(statistics.median(fractions), 3) if fractions else None
    return row


__all__ = ["RATIO_BOUNDS", "ratio_openings", "ratio_trial"]
