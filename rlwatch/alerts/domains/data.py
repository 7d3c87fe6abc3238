"""The training data: zero-variance groups, truncated responses, entropy collapse, non-finite log-probs."""

from __future__ import annotations

from ..conditions import gauge_rate, one, rate
from ..history import History, Verdicts
from ..model import Alert, Runbook, StepExample, const, with_step


def _entropy_collapse(h: History) -> Verdicts:
    e = h.latest("entropy_mean")
    recent = h.window("entropy_mean", (), last=120, skip=1)
    if e is None or not recent or len(recent) < h.p("baseline_steps"):
        return {}
    top = max(recent)
    h.stats[("baseline", "entropy_mean")] = top
    ratio = h.p("entropy_collapse_ratio")
    return one(e, e < ratio * top, e < ratio * top / h.p("hold_fraction"))


ZERO_VARIANCE_GROUPS_HIGH = Alert(
    name="RLWatchZeroVarianceGroupsHigh", severity="warning", for_steps=5,
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


ENTROPY_COLLAPSE = Alert(
    name="RLWatchEntropyCollapse", severity="warning", for_steps=3,
    params=("entropy_collapse_ratio", "baseline_steps", "hold_fraction", "clear_steps"),
    summary="Policy entropy collapsed.",
    description="Run {{ $labels.run }}: mean token entropy fell to {{ $value | printf \"%.4g\" }} nats.",
    windows="Entropy below `entropy_collapse_ratio` x its maximum over the previous 120 steps (at least "
            "`baseline_steps` of them), 3 steps running.",
    condition=_entropy_collapse,
    runbook=Runbook(
        meaning="The policy became nearly deterministic; exploration stops and every update is a larger "
                "step relative to the data's policy, which amplifies staleness.",
        causes=["Too high a learning rate or too many epochs per batch.", "A reward hack found and exploited.",
                "No entropy regularisation with a sharp reward."],
        look=["rlwatch_mismatch_kl_k3 and the drift scores; the reward per environment."],
        do=["Lower the learning rate, add an entropy bonus or KL penalty, or stop and resume earlier."]),
    example=StepExample(series=with_step(30, entropy_mean={(): const(1.0, 25) + const(0.1, 5)}),
                        fires_at=27, labels={}, value=0.1),
)


NON_FINITE_LOG_PROBS = Alert(
    name="RLWatchNonFiniteLogProbs", severity="warning", for_steps=3,
    params=("nonfinite_ratio_max", "evidence_z", "hold_fraction", "clear_steps"),
    summary="Log-probs are NaN or infinite.",
    description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of response tokens have a "
                 "non-finite log-prob (excluded from the mismatch signals)."),
    windows="Non-finite tokens / tokens over the last 10 steps, Wilson lower bound above the threshold, 3 "
            "steps running.",
    condition=rate("nonfinite_tokens_total", "tokens_total", 10, "nonfinite_ratio_max", lambda k: k),
    runbook=Runbook(
        meaning="A -inf sampler log-prob means the sampler reported a token its own truncated distribution "
                "excluded (top-p/top-k); NaN means a numeric fault in a kernel.",
        causes=["Top-p/top-k truncation in the reported log-probs.", "fp16 overflow, a bad kernel."],
        look=["rlwatch_sampler_top_p/top_k, rlwatch_mismatch_log_ratio_mean."],
        do=["Report untruncated log-probs from the sampler; check precision settings."]),
    example=StepExample(series=with_step(30, nonfinite_tokens_total={(): const(0.0, 10) + const(5.0, 20)},
                                         tokens_total={(): const(1000.0, 30)}),
                        fires_at=15, labels={}, value=0.003),
)


__all__ = ["ZERO_VARIANCE_GROUPS_HIGH", "TRUNCATION_RATE_HIGH", "ENTROPY_COLLAPSE", "NON_FINITE_LOG_PROBS"]
