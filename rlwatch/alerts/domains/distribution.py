"""The policy's token distribution: entropy collapse, non-finite log-probs."""

from __future__ import annotations

from ..conditions import past, rate
from ..history import History, Verdicts
from ..model import Alert, Param, Runbook, StepExample, const, with_step


#: The thresholds only this domain's alerts read (the shared ones: rlwatch.alerts.params.COMMON).
PARAMS: dict[str, Param] = {
    "entropy_collapse_ratio": Param(0.2, "Entropy below this fraction of its own maximum over the last 120 "
                                    "steps.", high=1.0),
    "nonfinite_ratio_max": Param(0.001, "Fraction of response tokens with a NaN or infinite log-prob (lower "
                                 "confidence bound).", high=1.0),
}


def _entropy_collapse(h: History) -> Verdicts:
    e = h.latest("entropy_mean")
    recent = h.window("entropy_mean", (), last=120, skip=1)
    if e is None or not recent or len(recent) < h.p("baseline_steps"):
        return {}
    top = max(recent)
    h.stats[("baseline", "entropy_mean")] = top
    return past(h, e, h.p("entropy_collapse_ratio") * top, below=True)


ENTROPY_COLLAPSE = Alert(
    name="RLWatchEntropyCollapse", severity="warning", for_steps=3,
    value_format="mean entropy {:.4g} nats",
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
    roles=("mismatch",),
    name="RLWatchNonFiniteLogProbs", severity="warning", for_steps=3,
    value_format="{:.2%} of tokens with a non-finite log-prob",
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


#: The domain's alerts, in page order.
ALERTS: tuple[Alert, ...] = (ENTROPY_COLLAPSE, NON_FINITE_LOG_PROBS)


__all__ = ["ALERTS", "PARAMS", "ENTROPY_COLLAPSE", "NON_FINITE_LOG_PROBS"]
