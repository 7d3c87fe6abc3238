"""Importance sampling: weights truncated by the TIS cap and a degenerate effective sample size."""

from __future__ import annotations

from ..conditions import latest_past, rate
from ..model import Alert, Param, Runbook, StepExample, const, with_step


#: The thresholds only this domain's alerts read (the shared ones: rlwatch.alerts.params.COMMON).
PARAMS: dict[str, Param] = {
    "tis_truncated_max": Param(0.05, "Fraction of tokens a TIS cap truncates (w > C), judged by its lower "
                               "confidence bound.", high=1.0),
    "ess_min": Param(0.3, "Normalised effective sample size below which IS weights are degenerate "
                     "(verl flags ESS < 0.3).", high=1.0),
}


IS_TRUNCATION_HIGH = Alert(
    roles=("importance",),
    name="RLWatchISTruncationHigh", severity="warning", for_steps=3,
    value_format="{:.1%} of tokens above the TIS cap",
    params=("tis_truncated_max", "evidence_z", "hold_fraction", "clear_steps"),
    summary="Many tokens have an importance weight above the TIS cap.",
    description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of tokens have pi_old/mu above "
                 "the cap C."),
    windows="Truncated tokens / tokens over the last 10 steps, Wilson lower bound above the threshold, 3 "
            "steps running.",
    condition=rate("is_tis_truncated_tokens_total", "mismatch_tokens_total", 10, "tis_truncated_max",
                   lambda k: k),
    runbook=Runbook(
        meaning="A truncated-IS correction now caps many weights, so it leaves bias behind; read it next to "
                "the raw mismatch, since a capped fraction alone misleads (in the Agent RL tutorial's chapter 13 "
                "experiments, weights below 1, not the cap, did the work).",
        causes=["Growing staleness or a sampler change.", "A policy sharpening fast."],
        look=["rlwatch_is_tis_low_ratio and rlwatch_is_ess_ratio.", "rlwatch_mismatch_kl_k3."],
        do=["Reduce staleness; consider MIS (masking) if outliers dominate, or a lower learning rate."]),
    example=StepExample(series=with_step(30, is_tis_truncated_tokens_total={(): const(1.0, 20) +
                                                                            const(200.0, 10)},
                                         mismatch_tokens_total={(): const(1000.0, 30)}),
                        fires_at=24, labels={}, value=0.1005),
)


ESS_LOW = Alert(
    roles=("importance",),
    name="RLWatchESSLow", severity="critical", for_steps=2, intermittent=True,
    value_format="normalised ESS {:.4g} (1 = uniform weights)",
    params=("ess_min", "intermittent_hits", "intermittent_steps", "hold_fraction", "clear_steps"),
    summary="Importance-sampling effective sample size is low.",
    description=("Run {{ $labels.run }}: normalised ESS of the truncated weights is "
                 "{{ $value | printf \"%.4g\" }}."),
    windows="ESS below `ess_min` for 2 steps, or on `intermittent_hits` of the last `intermittent_steps` steps; "
            "holds while below `ess_min` / `hold_fraction`.",
    condition=latest_past("is_ess_ratio", "ess_min", below=True),
    runbook=Runbook(
        meaning="A few tokens carry most of the importance weight: the corrected gradient rests on a "
                "small part of the batch and its variance explodes (full IS at a large mismatch had 10x "
                "the squared gradient as variance in the one-step problem of the Agent RL tutorial's chapter 13).",
        causes=["A large sampler-learner mismatch (see the KL alert).", "Very stale data."],
        look=["rlwatch_mismatch_chi2_token (ESS ~ 1/(1+chi2) for raw weights).",
              "rlwatch_is_tis_high_ratio and rlwatch_is_tis_low_ratio."],
        do=["Treat as a KL spike: checkpoint, find the cause, resume from the last healthy checkpoint."]),
    example=StepExample(series=with_step(4, is_ess_ratio={(): [0.95, 0.9, 0.2, 0.15]}),
                        fires_at=3, labels={}, value=0.15),
)


#: The domain's alerts, in page order.
ALERTS: tuple[Alert, ...] = (IS_TRUNCATION_HIGH, ESS_LOW)


__all__ = ["ALERTS", "PARAMS", "IS_TRUNCATION_HIGH", "ESS_LOW"]
