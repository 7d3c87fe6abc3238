"""The training data: zero-variance groups, truncated responses."""

from __future__ import annotations

from ..conditions import gauge_rate
from ..model import Alert, Param, Runbook, StepExample, const, with_step


#: The thresholds only this domain's alerts read (the shared ones: rlwatch.alerts.params.COMMON).
PARAMS: dict[str, Param] = {
    "zero_variance_max": Param(0.5, "Fraction of GRPO groups that are all-pass or all-fail (lower bound over "
                               "the last 5 steps' groups).", high=1.0),
    "truncated_max": Param(0.2, "Fraction of responses cut by the length limit or a timeout (lower bound over "
                           "the last 5 steps' responses).", high=1.0),
}


ZERO_VARIANCE_GROUPS_HIGH = Alert(
    name="RLWatchZeroVarianceGroupsHigh", severity="warning", for_steps=5,
    value_format="{:.1%} of groups without reward variance",
    params=("zero_variance_max", "evidence_z", "hold_fraction", "clear_steps"),
    labels=("run", "kind"),
    summary="Many GRPO groups carry no gradient.",
    description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of groups are {{ $labels.kind }}; "
                 "their advantages are all zero."),
    windows="The share of all-pass (all-fail) groups pooled over the last 5 steps' groups, Wilson lower "
            "bound above the threshold, 5 steps running.",
    condition=gauge_rate("zero_variance_groups_ratio", "groups", 5, "zero_variance_max", ("all_pass", "all_fail")),
    runbook=Runbook(
        meaning="GRPO normalises rewards within a group; a group whose rewards are all equal gets zero "
                "advantage and teaches nothing. all_pass means the prompts are too easy (or the reward is "
                "hacked); all_fail means too hard (or the grader is broken).",
        causes=["Curriculum too easy or too hard.", "A reward hack (all_pass) or a grader outage (all_fail).",
                "Infrastructure failures scored as reward 0 (rllm#710): keep them apart with `failed`."],
        look=["rlwatch_env_hack_ratio and rlwatch_env_failure_ratio.", "Reward per environment."],
        do=["Filter or resample prompts (dynamic sampling); fix the grader; check for hacks."]),
    example=StepExample(series=with_step(15, zero_variance_groups_ratio={("all_fail",): const(0.1, 5) +
                                                                         const(0.9, 10)},
                                         groups={(): const(32.0, 15)}),
                        fires_at=12, labels={"kind": "all_fail"}, value=0.9),
)


TRUNCATION_RATE_HIGH = Alert(
    name="RLWatchTruncationRateHigh", severity="warning", for_steps=5,
    value_format="{:.1%} of responses truncated",
    params=("truncated_max", "evidence_z", "hold_fraction", "clear_steps"),
    summary="Many responses hit the length limit or a timeout.",
    description="Run {{ $labels.run }}: {{ $value | humanizePercentage }} of responses were truncated.",
    windows="Truncated responses pooled over the last 5 steps, Wilson lower bound above the threshold, 5 "
            "steps running.",
    condition=gauge_rate("truncated_ratio", "sequences", 5, "truncated_max"),
    runbook=Runbook(
        meaning="Truncated episodes need a reward decision and are not a random subset (the longest "
                "5% are the hardest); masking them biases training toward short tasks.",
        causes=["Response lengths growing (often before a collapse or a length hack).",
                "A timeout set too tight for the environment."],
        look=["rlwatch_response_length_p99/max and the per-environment truncation table."],
        do=["Raise the limit or the timeout, or penalise length explicitly; check the length-reward drift."]),
    example=StepExample(series=with_step(15, truncated_ratio={(): const(0.05, 5) + const(0.6, 10)},
                                         sequences={(): const(256.0, 15)}),
                        fires_at=10, labels={}, value=0.6),
)


#: The domain's alerts, in page order.
ALERTS: tuple[Alert, ...] = (ZERO_VARIANCE_GROUPS_HIGH, TRUNCATION_RATE_HIGH)


__all__ = ["ALERTS", "PARAMS", "ZERO_VARIANCE_GROUPS_HIGH", "TRUNCATION_RATE_HIGH"]
