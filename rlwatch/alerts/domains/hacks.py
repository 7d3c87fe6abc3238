"""Reward hacks and infrastructure failures, per environment."""

from __future__ import annotations

from ..conditions import rate, wilson_lower
from ..history import History, Verdicts
from ..model import Alert, Param, Runbook, StepExample, const, with_step


#: The thresholds only this domain's alerts read (the shared ones: rlwatch.alerts.params.COMMON).
PARAMS: dict[str, Param] = {
    "hack_ratio_max": Param(0.1, "Fraction of an environment's episodes a reward-hack detector flags, judged by "
                            "the lower confidence bound over the last 10 steps.", high=1.0),
    "hack_jump_factor": Param(2.0, "To open, the hack rate's lower bound must also exceed this many times the "
                              "environment's own rate before the window.", low=1.0),
    "hack_baseline_steps": Param(5.0, "Steps with judged episodes needed before the window for the hack "
                                 "rate to count as rising."),
    "failure_ratio_max": Param(0.05, "Fraction of an environment's episodes failing for infrastructure reasons "
                               "(lower confidence bound).", high=1.0),
}


def _hack_rising(h: History) -> Verdicts:
    out: Verdicts = {}
    z, bound = h.p("evidence_z"), h.p("hack_ratio_max")
    judged, hacked = h.increments("episodes_judged_total", 10), h.increments("episodes_hacked_total", 10)
    before_judged = h.increments("episodes_judged_total", 60, skip=10)
    before_hacked = h.increments("episodes_hacked_total", 60, skip=10)
    for labels, n in judged.items():
        k = hacked.get(labels, 0.0)
        lower = wilson_lower(k, n, z)
        baseline_steps = h.steps_with("episodes_judged_total", labels, 60, skip=10)
        nb = before_judged.get(labels, 0.0)
        rising = (baseline_steps >= h.p("hack_baseline_steps") and nb > 0
                  and lower > h.p("hack_jump_factor") * before_hacked.get(labels, 0.0) / nb)
        out[labels] = (k / n, lower > bound and rising, lower > h.p("hold_fraction") * bound)
    return out


REWARD_HACK_RATE_RISING = Alert(
    name="RLWatchRewardHackRateRising", severity="critical", for_steps=1,
    value_format="{:.1%} of judged episodes flagged",
    params=("hack_ratio_max", "hack_jump_factor", "hack_baseline_steps", "evidence_z", "hold_fraction",
            "clear_steps"),
    labels=("run", "env", "detector"),
    summary="A reward-hack rate is high and rising in an environment.",
    description=("Run {{ $labels.run }}, environment {{ $labels.env }}: detector {{ $labels.detector }} flags "
                 "{{ $value | humanizePercentage }} of episodes, up from its own earlier level."),
    windows="Flagged / judged episodes over the last 10 steps. Opens when the Wilson lower bound exceeds "
            "`hack_ratio_max` and `hack_jump_factor` x the rate of the 60 steps before (at least "
            "`hack_baseline_steps` of them judged); holds while the lower bound stays above "
            "`hold_fraction` x `hack_ratio_max`, however high the rate climbs.",
    condition=_hack_rising,
    runbook=Runbook(
        meaning="The policy is learning to exploit a bug in this environment's reward; the reward rises "
                "while the true success does not. Hacks spread: once found, a hack's rate grows step "
                "after step.",
        causes=["A grader that accepts degenerate output (empty, repeated, format-only).",
                "A coding agent editing tests, the grader or conftest.",
                "A reward that correlates with length."],
        look=["`rlwatch postmortem` lists example episodes flagged by the detector.",
              "rlwatch_env_reward_mean of this environment against its held-out/true success."],
        do=["Stop training on this environment or fix its grader; resume from a checkpoint before the rise.",
            "Add the detector's check to the reward itself."]),
    example=StepExample(series=with_step(30, episodes_hacked_total={("buggy", "verifier"): const(1.0, 20) +
                                                                    const(30.0, 10)},
                                         episodes_judged_total={("buggy", "verifier"): const(100.0, 30)}),
                        fires_at=23, labels={"env": "buggy", "detector": "verifier"}, value=0.126),
)


INFRA_FAILURE_RATE_HIGH = Alert(
    name="RLWatchInfraFailureRateHigh", severity="warning", for_steps=3,
    value_format="{:.1%} of episodes failed",
    params=("failure_ratio_max", "evidence_z", "hold_fraction", "clear_steps"),
    labels=("run", "env", "kind"),
    summary="Episodes fail for infrastructure reasons.",
    description=("Run {{ $labels.run }}, environment {{ $labels.env }}: {{ $value | humanizePercentage }} of "
                 "episodes fail with {{ $labels.kind }}."),
    windows="Failed / all episodes of the environment over the last 10 steps, Wilson lower bound above the "
            "threshold, 3 steps running.",
    condition=rate("episodes_failed_total", "episodes_total", 10, "failure_ratio_max", lambda k: (k[0],)),
    runbook=Runbook(
        meaning="Containers crash, tests hang or graders error. Failures are not independent of the "
                "episode: with a constant hazard the longest tenth failed three times as often, so "
                "dropping them biases training toward short tasks, and scoring them 0 teaches the "
                "policy to avoid whatever made containers crash.",
        causes=["Worker out-of-memory, container start-up failures, a flaky grader."],
        look=["rlwatch_env_failure_ratio by kind; the environment workers' own logs."],
        do=["Keep failures out of the reward (no gradient), retry them, fix the environment."]),
    example=StepExample(series=with_step(30, episodes_failed_total={("swe", "timeout"): const(0.0, 10) +
                                                                    const(10.0, 20)},
                                         episodes_total={("swe",): const(100.0, 30)}),
                        fires_at=18, labels={"env": "swe", "kind": "timeout"}, value=0.09),
)


#: The domain's alerts, in page order.
ALERTS: tuple[Alert, ...] = (REWARD_HACK_RATE_RISING, INFRA_FAILURE_RATE_HIGH)


__all__ = ["ALERTS", "PARAMS", "REWARD_HACK_RATE_RISING", "INFRA_FAILURE_RATE_HIGH"]
