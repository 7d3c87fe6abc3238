"""Staleness: tokens over the staleness bound and a maximum lag far above it."""

from __future__ import annotations

from ..conditions import past, rate
from ..history import History, Verdicts
from ..model import Alert, Param, Runbook, StepExample, const, with_step


#: The thresholds only this domain's alerts read (the shared ones: rlwatch.alerts.params.COMMON).
PARAMS: dict[str, Param] = {
    "staleness_over_bound_max": Param(0.0, "Fraction of tokens allowed above the staleness bound.", high=1.0),
    "lag_critical_factor": Param(2.0, "Maximum lag above this many times the staleness bound is critical.",
                                 low=1.0),
}


def _lag_far(h: History) -> Verdicts:
    lag, bound = h.latest("version_lag_max"), h.latest("staleness_bound")
    if lag is None or bound is None:
        return {}
    return past(h, lag, h.p("lag_critical_factor") * bound, hold=bound)


STALENESS_BOUND_EXCEEDED = Alert(
    roles=("lag",),
    name="RLWatchStalenessBoundExceeded", severity="warning", for_steps=3,
    value_format="{:.1%} of tokens over the staleness bound",
    params=("staleness_over_bound_max", "evidence_z", "clear_steps"),
    summary="Tokens older than the staleness bound are being trained on.",
    description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of tokens exceed the staleness "
                 "bound."),
    windows="Tokens over the bound / tokens over the last 10 steps (Wilson lower bound), 3 steps running.",
    condition=rate("tokens_over_staleness_bound_total", "tokens_total", 10, "staleness_over_bound_max",
                   lambda k: k),
    runbook=Runbook(
        meaning="A count-based throttle bounds the mean staleness, not the maximum: stragglers started "
                "under an old version are trained several versions later (the simulator's async eta=2 "
                "design had mean staleness 1.5 but maximum 7).",
        causes=["Long-tailed episodes in a partial-rollout pipeline.",
                "The bound is enforced at generation but not at consumption."],
        look=["The lag heatmap and rlwatch_version_lag_p99/max.",
              "rlwatch_partial_rollout_ratio."],
        do=["Drop or down-weight episodes older than the bound at consumption.",
            "Keep TIS on so that stale tokens are corrected."]),
    example=StepExample(series=with_step(30, tokens_over_staleness_bound_total={(): const(0.0, 20) +
                                                                                const(50.0, 10)},
                                         tokens_total={(): const(1000.0, 30)}),
                        fires_at=22, labels={}, value=0.015),
)


VERSION_LAG_FAR_ABOVE_BOUND = Alert(
    roles=("lag",),
    name="RLWatchVersionLagFarAboveBound", severity="critical", for_steps=2, intermittent=True,
    value_format="oldest token {:g} versions stale",
    params=("lag_critical_factor", "intermittent_hits", "intermittent_steps", "clear_steps"),
    summary="Maximum version lag is far above the staleness bound.",
    description=("Run {{ $labels.run }}: the oldest token trained is {{ $value }} updates stale."),
    windows="The maximum lag above `lag_critical_factor` x the staleness bound for 2 steps, or on "
            "`intermittent_hits` of the last `intermittent_steps` steps (one replica of several that no longer "
            "syncs); holds while it stays above the bound.",
    condition=_lag_far,
    runbook=Runbook(
        meaning="Some data is many updates older than the pipeline allows. In the staleness experiment "
                "of chapter 13 of the Agent RL tutorial (agent-rl.tacetai.com) lag 8 without correction "
                "destroyed the skill while lag 2 was harmless.",
        causes=["Weight sync not happening: the lag grows by one every step (trl#5312).",
                "A stuck rollout worker whose episodes finish much later.",
                "A replay buffer that keeps old episodes."],
        look=["Does rlwatch_version_lag_max grow linearly with rlwatch_trainer_version? Then sync is broken.",
              "rlwatch_mismatch_kl_k3 over the same window."],
        do=["Fix the weight sync or restart the rollout workers.",
            "Enforce the staleness bound at consumption."]),
    example=StepExample(series=with_step(4, version_lag_max={(): [1.0, 2.0, 9.0, 9.0]},
                                         staleness_bound={(): const(4.0, 4)}),
                        fires_at=3, labels={}, value=9.0),
)


#: The domain's alerts, in page order.
ALERTS: tuple[Alert, ...] = (STALENESS_BOUND_EXCEEDED, VERSION_LAG_FAR_ABOVE_BOUND)


__all__ = ["ALERTS", "PARAMS", "STALENESS_BOUND_EXCEEDED", "VERSION_LAG_FAR_ABOVE_BOUND"]
