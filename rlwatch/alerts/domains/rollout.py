"""The rollout system: the launched episodes that were not trained shorten the trained data."""

from __future__ import annotations

from ..conditions import past
from ..history import History, Verdicts
from ..model import Alert, Param, Runbook, StepExample, const, with_step


#: The thresholds only this domain's alerts read (the shared ones: rlwatch.alerts.params.COMMON).
PARAMS: dict[str, Param] = {
    "length_bias_max": Param(0.07, "How much shorter the trained episodes may be than the launched ones, as 1 - "
                             "the mean trained/launched duration ratio over 10 steps (chosen on the tuning runs "
                             "of evaluation.rollout_bias, alerts/length-bias-acceptance.md).", high=1.0),
}

#: Steps the length-bias statistic averages over, and how many of them must carry the ratio.
LENGTH_BIAS_STEPS = 10
LENGTH_BIAS_MIN_STEPS = 5


def length_bias(h: History) -> Verdicts:
    """1 - the mean of ``length_bias_duration_ratio`` (trained over launched mean episode duration)
    over the last :data:`LENGTH_BIAS_STEPS` steps: how much shorter the trained episodes are than the
    launched ones. Raises above ``length_bias_max``, holds above ``hold_fraction`` of it; the
    verdict's value is the mean ratio."""
    ratios = h.window("length_bias_duration_ratio", (), last=LENGTH_BIAS_STEPS)
    if len(ratios) < LENGTH_BIAS_MIN_STEPS or h.latest("length_bias_duration_ratio") is None:
        return {}
    mean = sum(ratios) / len(ratios)
    return past(h, 1.0 - mean, h.p("length_bias_max"), shown=mean)


ROLLOUT_LENGTH_BIAS = Alert(
    name="RLWatchRolloutLengthBias", severity="warning", for_steps=3,
    value_format="trained/launched episode duration {:.3g}x",
    params=("length_bias_max", "hold_fraction", "clear_steps"),
    summary="The trained episodes are shorter than the launched ones.",
    description=("Run {{ $labels.run }}: trained episodes last {{ $value | printf \"%.3g\" }} x the mean "
                 "duration of the launched ones (timeouts, failures, filters or over-sampling drop the long ones)."),
    windows="1 - mean of rlwatch_length_bias_duration_ratio over the last 10 steps (at least 5 carrying it) "
            "above `length_bias_max`, 3 steps running.",
    condition=length_bias,
    runbook=Runbook(
        meaning="Episodes launched but not trained (timed out, failed, filtered, over-sampled, stale at "
                "consumption) are not a random subset: with a constant failure hazard the longest tenth "
                "fails three times as often, and over-sampling keeps the first to finish. The trained data "
                "drift toward short, easy tasks.",
        causes=["Environment failures dropped instead of retried or kept without gradient.",
                "A timeout below the duration tail.", "Over-sampling: training on the first B to finish.",
                "Staleness enforced at consumption dropping the stragglers."],
        look=["rlwatch_episodes_dropped_total by reason and environment.",
              "rlwatch_trained_episode_duration_mean_seconds vs rlwatch_launched_episode_duration_mean_seconds.",
              "The duration tail per environment (rlwatch_env_episode_duration_p95_seconds)."],
        do=["Keep failed episodes' tasks in the next batch (no gradient) rather than dropping them.",
            "Raise the timeout to the tail, or use partial rollouts instead of over-sampling."]),
    example=StepExample(series=with_step(20, length_bias_duration_ratio={(): const(1.0, 10) + const(0.8, 10)}),
                        fires_at=15, labels={}, value=0.88),
)


#: The domain's alerts, in page order.
ALERTS: tuple[Alert, ...] = (ROLLOUT_LENGTH_BIAS,)


__all__ = ["ALERTS", "PARAMS", "ROLLOUT_LENGTH_BIAS", "length_bias"]
