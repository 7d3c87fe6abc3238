"""The trainer's own dynamics, the precursors of a collapse: entropy surging, the policy KL between
consecutive policies departing, the gradient norm spiking or dead (0 or non-finite), the response length
running away or the clipped ratio surging, and the reward (the held-out score when one is logged) sliding
from its running peak. Each is a warning on its own; several moving together within a few steps page
(RLWatchCollapsePrecursors). Entropy falling is RLWatchEntropyCollapse (the distribution domain).

Every baseline is the run's own: the median of a signal over the 30 logged values ending 10 before the
latest (at least ``dynamics_baseline_rows`` of them; in a short run ending as few as 5 before, so a run of
20 logged rows is judged from its 15th), so a slow change such as a learning-rate warm-up moves the
baseline with it while a climb over a few tens of values stands out; the compared level is the median of
the last 5 values, so one noisy value does not raise, and it must also pass a high quantile of the
baseline's own values (``dynamics_noise_quantile``), so a signal that already swung that high is not
rising. No condition raises without its baseline. The conditions count logged values, not steps
(:func:`rows`): a trainer that logs every k steps (TRL's ``logging_steps``) is judged on its rows, each
verdict standing until the next row. A row whose every group had equal rewards (the trainer's logged
zero-std ratio at 1, or every group ``observe`` saw all pass or all fail: no learning signal) is left out of
the entropy, gradient, policy KL and length series.
"""

from __future__ import annotations

import math
import statistics

from ..conditions import one
from ..history import History, Verdicts
from ..model import Alert, Param, Runbook, StepExample, const, with_step
from ..trend import forecast_steps
from ..template import POLICY_KL_FORECAST

#: Steps of the trailing baseline, and the steps before the latest at which it ends.
BASELINE_STEPS, BASELINE_GAP = 30, 10
#: Logged values of the median compared with the baseline.
SMOOTH = 5
#: Logged values kept per signal (the baseline reads the 40 before the latest 0).
KEPT = 60
#: The reward slide: steps of the median whose running maximum is the peak, and of the median compared with it
#: (a peak of 5-step medians over a long flat run is noise's maximum, not a level the run reached).
SLIDE_PEAK, SLIDE_NOW = 20, 10

PARAMS: dict[str, Param] = {
    "entropy_surge_factor": Param(1.5, "Entropy's 5-step median this many times its trailing baseline is a "
                                  "surge (RLWatchEntropySurge).", above=1.0),
    "policy_kl_factor": Param(4.0, "The policy KL's 5-step median this many times its trailing baseline, and "
                              "above policy_kl_floor, is a departure (RLWatchPolicyKLDeparture).", above=1.0),
    "policy_kl_floor": Param(0.1, "No policy-KL departure while its 5-step median stays below this (nats): "
                             "healthy public runs (docs/real-runs.md) pass 4x their early level while the entropy "
                             "falls, below 0.1.", above=0.0),
    "policy_kl_max": Param(0.1, "Policy KL (nats) the forecast counts the steps to (window_forecast_steps).",
                           above=0.0),
    "grad_spike_factor": Param(5.0, "A gradient norm this many times its trailing baseline median is a spike "
                               "(RLWatchGradNormSpike).", above=1.0),
    "length_runaway_factor": Param(1.5, "Mean response length's 5-step median this many times its trailing "
                                   "baseline is a runaway (RLWatchLengthRunaway).", above=1.0),
    "clipped_ratio_rise": Param(0.1, "The truncated (clipped-response) ratio's 5-step median this far above its "
                                "trailing baseline (absolute fraction) is a surge (RLWatchLengthRunaway).",
                                above=0.0, high=1.0),
    "reward_slide_fraction": Param(0.3, "The reward's 10-step median below its running peak of 20-step medians "
                                   "by this fraction of the run's gain (the peak minus its first 20-step median) is a "
                                   "slide (RLWatchRewardSlide).", above=0.0, high=1.0),
    "reward_slide_z": Param(3.0, "RLWatchRewardSlide needs the drop to exceed this many standard deviations of the "
                            "reward's step-to-step noise too.", above=0.0),
    "dynamics_noise_quantile": Param(0.9, "A precursor's level must also pass this quantile of its own trailing "
                                     "baseline values: a signal that already swung that high in the baseline (a run "
                                     "whose steps alternate between groups with and without reward variance) is "
                                     "not rising (RLWatchEntropySurge, RLWatchPolicyKLDeparture, RLWatchGradNormSpike, "
                                     "RLWatchLengthRunaway).", above=0.0, high=1.0),
    "dynamics_baseline_rows": Param(10.0, "Logged values a precursor's trailing baseline needs (RLWatchEntropySurge, "
                                    "RLWatchPolicyKLDeparture, RLWatchGradNormSpike, RLWatchLengthRunaway): a run "
                                    "logging 20 rows is judged from its 15th on.", low=3.0),
    "precursor_steps": Param(10.0, "Logged rows (steps, where the trainer logs every step) within which two "
                             "different precursors raising page (RLWatchCollapsePrecursors).", low=1.0),
}


#: The signals of the trained batch and its update, left out of the precursors' series on a row where every group's
#: rewards were equal (zero-std share at 1): that step had no learning signal, and its values
#: are those of prompts the policy has settled (a run of one prompt a step swings between such rows and live ones).
BATCH_SIGNALS = ("entropy_mean", "grad_norm", "policy_kl", "response_length_mean")


def _zero_std_share(h: History) -> float | None:
    """The step's share of groups whose rewards were all equal: the trainer's logged zero-std ratio (TRL's
    ``frac_reward_zero_std``), else rlwatch's own count from ``observe``'s groups (all pass + all fail)."""
    logged = h.latest("zero_std_ratio")
    if logged is not None:
        return logged
    kinds = h.family("zero_variance_groups_ratio")
    return sum(kinds.values()) if kinds else None


def _no_learning_signal(h: History) -> bool:
    """Every group of the step had equal rewards: zero advantage everywhere, nothing to learn from."""
    share = _zero_std_share(h)
    return share is not None and share >= 1.0 - 1e-9


def _series(h: History, name: str) -> list[float]:
    """The signal's logged values, oldest first (the last :data:`KEPT`), one per step that carries it (but for
    :data:`BATCH_SIGNALS` on a step without a learning signal): a trainer that logs every k steps (TRL:
    ``logging_steps``) is judged row by row."""
    memory = h.memory.setdefault(("series", name), {"step": None, "values": []})
    if memory["step"] != h.step:
        memory["step"] = h.step
        value = h.latest(name)
        if value is not None and not (name in BATCH_SIGNALS and _no_learning_signal(h)):
            memory["values"] = (memory["values"] + [value])[-KEPT:]
    return memory["values"]


def _median(h: History, name: str, last: int = SMOOTH, skip: int = 0) -> float | None:
    values = _series(h, name)
    chosen = values[max(0, len(values) - skip - last):max(0, len(values) - skip)]
    return statistics.median(chosen) if chosen else None


def _baseline_values(h: History, name: str) -> list[float]:
    """The values the trailing baseline reads: the 30 logged values ending 10 before the latest; in a run
    with fewer values, ending fewer before (at least :data:`SMOOTH`, so the compared median never
    overlaps them) once ``dynamics_baseline_rows`` of them are there."""
    values = _series(h, name)
    gap = min(BASELINE_GAP, max(SMOOTH, len(values) - int(h.p("dynamics_baseline_rows"))))
    return values[max(0, len(values) - gap - BASELINE_STEPS):max(0, len(values) - gap)]


def _baseline(h: History, name: str) -> float | None:
    """The trailing baseline (the median of :func:`_baseline_values`); None before ``dynamics_baseline_rows``
    of them."""
    values = _baseline_values(h, name)
    if len(values) < h.p("dynamics_baseline_rows"):
        return None
    base = statistics.median(values)
    h.stats[("baseline", name)] = base
    return base


def _noise_top(h: History, name: str) -> float:
    """The ``dynamics_noise_quantile`` of the trailing baseline's values (nearest rank): how high the signal
    already went while the run was at its baseline."""
    values = sorted(_baseline_values(h, name))
    return values[max(0, min(len(values) - 1, math.ceil(h.p("dynamics_noise_quantile") * len(values)) - 1))]


def rows(key: str, signals: tuple[str, ...], hits: int = 3, of: int = 3):
    """Judge a condition once per logged row of ``signals``: it raises when its raw raise held on ``hits`` of
    the last ``of`` rows; on a step that logs none of them the last row's verdict stands (a trainer that
    logs every k steps is judged on its rows, not on the steps between them)."""
    def wrap(condition):
        def judged(h: History) -> Verdicts:
            memory = h.memory.setdefault(("rows", key), {"step": None, "last": {}, "recent": {}})
            if memory["step"] == h.step or all(h.latest(s) is None for s in signals):
                return dict(memory["last"])
            out: Verdicts = {}
            for labels, (value, raise_, hold) in condition(h).items():
                recent = memory["recent"][labels] = (memory["recent"].get(labels, []) + [raise_])[-of:]
                out[labels] = (value, sum(recent) >= hits, hold or raise_)
            memory["step"], memory["last"] = h.step, out
            return out
        judged.raw, judged.signals = condition, signals
        return judged
    return wrap


def _ratio_rise(h: History, name: str, factor: float, floor: float = 0.0) -> Verdicts:
    """The 5-step median against ``factor`` x the trailing baseline (and ``floor``)."""
    if h.latest(name) is None:
        return {}
    base, now = _baseline(h, name), _median(h, name)
    if base is None or now is None or base <= 0:
        return {}
    bound = max(factor * base, floor, _noise_top(h, name))
    return one(now / base, now > bound, now > base + h.p("hold_fraction") * (bound - base))


def _row(h: History) -> int:
    """The logged rows of the precursors' signals (:data:`PRECURSOR_SIGNALS`) up to this step, a step
    counted once: precursor_steps counts rows, as the precursors do."""
    memory = h.memory.setdefault("precursor_rows", {"step": None, "rows": 0})
    if memory["step"] != h.step and any(h.latest(s) is not None for s in PRECURSOR_SIGNALS):
        memory["step"], memory["rows"] = h.step, memory["rows"] + 1
    return memory["rows"]


def _remember(h: History, name: str, verdicts: Verdicts) -> Verdicts:
    """Note the row at which a precursor raised (RLWatchCollapsePrecursors reads it)."""
    if any(raise_ for _, raise_, _ in verdicts.values()):
        h.memory.setdefault("precursors", {})[name] = _row(h)
    return verdicts


@rows("entropy", ("entropy_mean",))
def _entropy_surge(h: History) -> Verdicts:
    return _remember(h, "entropy", _ratio_rise(h, "entropy_mean", h.p("entropy_surge_factor")))


@rows("policy_kl", ("policy_kl",))
def _policy_kl(h: History) -> Verdicts:
    steps = forecast_steps(h, h.p("policy_kl_max"), "policy_kl")
    if steps is not None:
        h.stats[("forecast_steps", "policy_kl")] = steps
    return _remember(h, "policy_kl", _ratio_rise(h, "policy_kl", h.p("policy_kl_factor"), h.p("policy_kl_floor")))


@rows("grad_norm", ("grad_norm",), hits=2, of=4)
def _grad_spike(h: History) -> Verdicts:
    g = h.latest("grad_norm")
    base = _baseline(h, "grad_norm")
    if g is None or base is None or base <= 0:
        return {}
    bound = max(h.p("grad_spike_factor") * base, _noise_top(h, name="grad_norm"))
    return _remember(h, "grad_norm", one(g / base, g > bound, g > base + h.p("hold_fraction") * (bound - base)))


@rows("grad_dead", ("grad_norm_zero", "grad_norm_nonfinite", "loss_nonfinite"))
def _grad_dead(h: History) -> Verdicts:
    flags = [h.latest(name) for name in ("grad_norm_zero", "grad_norm_nonfinite", "loss_nonfinite")]
    if all(flag is None for flag in flags):
        return {}
    previous = h.memory.get(("rows", "grad_dead"), {}).get("step")      # the row before, as rows() judged it
    # A zero gradient of equal rewards is the data's, not a dead trainer: on a step with no learning signal, or on
    # a row standing for several steps (a trainer that logs every k) of which some had none: the row carries the
    # zero-std ratio's mean over its steps but the last step's gradient norm (transformers' Trainer).
    share = _zero_std_share(h)
    spans_steps = previous is not None and h.step - previous > 1
    if _no_learning_signal(h) or (spans_steps and share is not None and share > 0.0):
        flags[0] = 0.0
    dead = any(flags)
    return _remember(h, "grad_dead", one(1.0 if dead else 0.0, dead, dead))


@rows("length", ("response_length_mean", "truncated_ratio"))
def _length_runaway(h: History) -> Verdicts:
    out: Verdicts = {}
    for value in _ratio_rise(h, "response_length_mean", h.p("length_runaway_factor")).values():
        out[("response_length_mean",)] = value
    base, now = _baseline(h, "truncated_ratio"), _median(h, "truncated_ratio")
    if h.latest("truncated_ratio") is not None and base is not None and now is not None:
        rise = h.p("clipped_ratio_rise")
        out[("truncated_ratio",)] = (now, now > base + rise, now > base + h.p("hold_fraction") * rise)
    return _remember(h, "length", out)


def _reward_signal(h: History) -> str:
    return "heldout_score" if _series(h, "heldout_score") else "reward_mean"


@rows("reward", ("reward_mean", "heldout_score"))
def _reward_slide(h: History) -> Verdicts:
    name = _reward_signal(h)
    now = _median(h, name, last=SLIDE_NOW)
    memory = h.memory.setdefault(("reward_peak", name), {"step": None, "start": None, "peak": None, "seen": 0})
    if h.latest(name) is None or now is None:
        return {}
    if memory["step"] != h.step:
        memory["step"], memory["seen"] = h.step, memory["seen"] + 1
        level = _median(h, name, last=SLIDE_PEAK)
        if memory["seen"] == SLIDE_PEAK:
            memory["start"] = level
        if memory["seen"] >= SLIDE_PEAK and (memory["peak"] is None or level > memory["peak"]):
            memory["peak"] = level
    start, peak = memory["start"], memory["peak"]
    values = _series(h, name)
    earlier = values[max(0, len(values) - SLIDE_NOW - BASELINE_STEPS):max(0, len(values) - SLIDE_NOW)]
    if start is None or memory["seen"] < h.p("baseline_steps") or len(earlier) < 3:
        return {}
    # the reward's step-to-step noise, free of its trend: the spread of consecutive differences / sqrt 2
    band = h.p("reward_slide_z") * statistics.stdev(b - a for a, b in zip(earlier, earlier[1:])) / math.sqrt(2)
    h.stats[("baseline", name)] = peak
    # a fraction of what the run gained, and beyond the noise (a run that gained nothing: the noise alone)
    drop, bound = peak - now, max(h.p("reward_slide_fraction") * (peak - start), band)
    return {(name,): (now, drop > bound, drop > h.p("hold_fraction") * bound)}


def _precursors(h: History) -> Verdicts:
    for condition in PRECURSOR_CONDITIONS:      # each notes its raise once per step, whoever asks first
        condition(h)
    seen = h.memory.get("precursors", {})
    now = _row(h)
    recent = [name for name, row in seen.items() if now - row < h.p("precursor_steps")]
    if not seen:
        return {}
    count = float(len(recent))
    return one(count, count >= 2, count >= 1)


PRECURSOR_CONDITIONS = (_entropy_surge, _policy_kl, _grad_spike, _grad_dead, _length_runaway, _reward_slide)
#: The signals the precursors judge: a step that logs one of them is a row of RLWatchCollapsePrecursors.
PRECURSOR_SIGNALS = tuple(dict.fromkeys(name for condition in PRECURSOR_CONDITIONS for name in condition.signals))


def _runbook(meaning: str, causes: list[str], look: list[str], do: list[str]) -> Runbook:
    return Runbook(meaning=meaning, causes=causes, look=look, do=do)


RESUME = ("If the reward has started to fall: stop, and resume from the last checkpoint saved before the first "
          "precursor (`rlwatch postmortem` names it) with the learning rate halved.")

ENTROPY_SURGE = Alert(
    name="RLWatchEntropySurge", severity="warning", for_steps=1,
    value_format="entropy {:.3g}x its baseline",
    params=("entropy_surge_factor", "dynamics_baseline_rows", "dynamics_noise_quantile", "hold_fraction",
            "clear_steps"),
    summary="Policy entropy surged above this run's baseline.",
    description="Run {{ $labels.run }}: mean token entropy is {{ $value | printf \"%.2g\" }}x its trailing baseline.",
    windows="Entropy's 5-step median over its trailing baseline (the median of the 30 logged values ending 10 "
            "before, at least `dynamics_baseline_rows` of them) above `entropy_surge_factor`, and above the "
            "`dynamics_noise_quantile` of those baseline values, 3 logged values running.",
    condition=_entropy_surge,
    runbook=_runbook(
        "The policy is becoming more random: updates are destroying what it learned rather than sharpening it. "
        "Entropy doubling has come ten steps before a reward collapse.",
        ["Too high a learning rate or too large an update (check rlwatch_policy_kl).",
         "Gradient spikes (rlwatch_grad_norm) or a loss scale problem in mixed precision.",
         "An entropy bonus that outweighs the policy loss."],
        ["rlwatch_entropy_mean against rlwatch_window_baseline{signal=\"entropy_mean\"}.",
         "rlwatch_policy_kl, rlwatch_grad_norm and rlwatch_reward_mean over the same steps."],
        ["Lower the learning rate (or its peak after warm-up); lower the entropy coefficient.",
         "Raise the KL coefficient to hold the policy near the reference.", RESUME]),
    example=StepExample(series=with_step(50, entropy_mean={(): [0.5, 0.52] * 20 + const(1.2, 10)}),
                        fires_at=44, labels={}, value=2.353),
)

POLICY_KL = Alert(
    name="RLWatchPolicyKLDeparture", severity="warning", for_steps=1,
    value_format="policy KL {:.3g}x its baseline",
    params=("policy_kl_factor", "policy_kl_floor", "dynamics_baseline_rows", "dynamics_noise_quantile",
            "hold_fraction", "clear_steps"),
    summary="The KL between consecutive policies left this run's baseline.",
    description="Run {{ $labels.run }}: the policy KL per update is {{ $value | printf \"%.2g\" }}x its trailing "
                "baseline" + POLICY_KL_FORECAST + ".",
    windows="The policy KL's 5-step median above the largest of `policy_kl_factor` x its trailing baseline, "
            "`policy_kl_floor` and the `dynamics_noise_quantile` of the baseline values, 3 logged values running; "
            "rlwatch_window_forecast_steps{signal=\"policy_kl\"} "
            "counts the steps to `policy_kl_max` at its log-linear trend.",
    condition=_policy_kl,
    runbook=_runbook(
        "Each update moves the policy further than it did: the step size is growing. The policy KL has passed "
        "0.1 thirteen steps before a collapse whose sampler mismatch barely moved.",
        ["A learning rate too high for this stage (after warm-up, or after a schedule restart).",
         "Advantages growing in scale (few non-zero-variance groups, reward scale change).",
         "The clip not applied (check rlwatch_clip_fraction)."],
        ["rlwatch_policy_kl and rlwatch_window_forecast_steps{signal=\"policy_kl\"}.",
         "rlwatch_clip_fraction and rlwatch_grad_norm over the same steps."],
        ["Lower the learning rate; raise the KL coefficient; tighten the PPO clip range.", RESUME]),
    example=StepExample(series=with_step(50, policy_kl={(): [0.02, 0.025] * 20 + const(0.25, 10)}),
                        fires_at=44, labels={}, value=11.11),
)

GRAD_SPIKE = Alert(
    name="RLWatchGradNormSpike", severity="warning", for_steps=1,
    value_format="gradient norm {:.3g}x its baseline",
    params=("grad_spike_factor", "dynamics_baseline_rows", "dynamics_noise_quantile", "hold_fraction",
            "clear_steps"),
    summary="The gradient norm is spiking.",
    description="Run {{ $labels.run }}: the gradient norm is {{ $value | printf \"%.2g\" }}x its trailing baseline.",
    windows="The gradient norm above `grad_spike_factor` x its trailing baseline median, and above the "
            "`dynamics_noise_quantile` of the baseline values, on 2 of the last 4 logged values.",
    condition=_grad_spike,
    runbook=_runbook(
        "Repeated gradient spikes precede divergence: a few sequences or tokens dominate the update.",
        ["Rare tokens with extreme importance ratios or advantages.", "A learning rate too high.",
         "Mixed-precision overflow (a loss scale jump)."],
        ["rlwatch_grad_norm against rlwatch_window_baseline{signal=\"grad_norm\"}; rlwatch_is_ratio_max.",
         "rlwatch_policy_kl and rlwatch_entropy_mean after the spikes."],
        ["Lower max_grad_norm (clip harder) or the learning rate.", RESUME]),
    example=StepExample(series=with_step(45, grad_norm={(): [0.5, 0.6] * 20 + [5.0, 0.5, 5.0, 0.5, 0.5]}),
                        fires_at=42, labels={}, value=9.091),
)

GRAD_DEAD = Alert(
    name="RLWatchGradNormDead", severity="critical", for_steps=1,
    value_format="unusable gradient {:.0f} (1: zero or non-finite gradient norm or loss)",
    params=("clear_steps",),
    summary="No usable gradient: its norm is 0, or it or the loss is NaN or infinite.",
    description="Run {{ $labels.run }}: the gradient norm has been 0 or non-finite (or the loss non-finite) for "
                "several steps.",
    windows="rlwatch_grad_norm_zero, rlwatch_grad_norm_nonfinite or rlwatch_loss_nonfinite at 1, 3 logged values "
            "running; a zero gradient does not count on a row whose groups all had equal rewards "
            "(rlwatch_zero_std_ratio at 1, or rlwatch_zero_variance_groups_ratio summing to 1: no learning signal, "
            "the data's condition), nor on a row standing for several steps some of which had none (the zero-std "
            "ratio above 0: the row carries its mean over the steps, but the last step's gradient norm).",
    condition=_grad_dead,
    runbook=_runbook(
        "The trainer is not learning: a zero gradient means no learning signal (every group has zero reward "
        "variance, or everything is masked); a non-finite one means the update is skipped or the weights are "
        "already corrupted. In a collapsed run the gradient norm sat at exactly 0 from the collapse on.",
        ["All groups constant (rlwatch_zero_variance_groups_ratio) or all tokens masked.",
         "Overflow in bf16/fp16, a NaN in the reward or the log-probs, a diverged model."],
        ["rlwatch_grad_norm_zero / _nonfinite and rlwatch_loss_nonfinite; rlwatch_zero_variance_groups_ratio.",
         "rlwatch_step_nonfinite_tokens and rlwatch_step_nonfinite_rewards."],
        ["Stop the run: the weights may be corrupted.",
         "Resume from the last checkpoint before the first non-finite step, with a lower learning rate."]),
    example=StepExample(series=with_step(8, grad_norm_zero={(): const(0.0, 4) + const(1.0, 4)}),
                        fires_at=6, labels={}, value=1.0),
)

LENGTH_RUNAWAY = Alert(
    name="RLWatchLengthRunaway", severity="warning", for_steps=1, labels=("run", "signal"),
    value_format="length {:.3g} (response length: times its baseline; clipped ratio: fraction of responses)",
    params=("length_runaway_factor", "clipped_ratio_rise", "dynamics_baseline_rows", "dynamics_noise_quantile",
            "hold_fraction", "clear_steps"),
    summary="Responses are running away in length, or the clipped ratio surged.",
    description="Run {{ $labels.run }}: {{ $labels.signal }} is {{ $value | printf \"%.3g\" }} (its trailing "
                "baseline: rlwatch_window_baseline).",
    windows="The mean response length's 5-step median above `length_runaway_factor` x its trailing baseline (and "
            "the `dynamics_noise_quantile` of the baseline values), or "
            "the truncated ratio's 5-step median `clipped_ratio_rise` above its trailing baseline, 3 logged values "
            "running.",
    condition=_length_runaway,
    runbook=_runbook(
        "Responses grow until the length limit cuts them: the clipped responses carry no final answer, the reward "
        "falls, and the policy learns from truncated text.",
        ["A reward that favours length (a hack), or repetition loops after an entropy change.",
         "An overlong penalty missing or switched off."],
        ["rlwatch_response_length_mean, rlwatch_truncated_ratio and rlwatch_env_reward_length_corr.",
         "Sample completions at the latest steps: repetition, unfinished reasoning."],
        ["Add or raise the overlong penalty; lower the learning rate.", RESUME]),
    example=StepExample(series=with_step(50, response_length_mean={(): [300.0, 310.0] * 20 + const(700.0, 10)}),
                        fires_at=44, labels={"signal": "response_length_mean"}, value=2.2951),
)

REWARD_SLIDE = Alert(
    name="RLWatchRewardSlide", severity="warning", for_steps=1, labels=("run", "signal"),
    value_format="reward {:.4g} (median of the latest logged values)",
    params=("reward_slide_fraction", "reward_slide_z", "baseline_steps", "hold_fraction", "clear_steps"),
    summary="The reward is sliding from its peak: the collapse is under way.",
    description="Run {{ $labels.run }}: {{ $labels.signal }} is {{ $value | printf \"%.4g\" }}, down from its "
                "running peak.",
    windows="The reward's 10-step median (the held-out score when one is logged) below its running peak of 20-step "
            "medians by `reward_slide_fraction` of the run's gain (the peak minus its first 20-step median) and by "
            "`reward_slide_z` standard deviations of the reward's step-to-step noise, "
            "after `baseline_steps` logged values, 3 logged values running.",
    condition=_reward_slide,
    runbook=_runbook(
        "The last line: the run is losing what it learned. The precursors above (entropy, policy KL, gradient, "
        "length) usually moved first.",
        ["Any of the precursors; a reward hack whose reward model was fixed; a data or environment change."],
        ["The other alerts of the run and `rlwatch postmortem`: which signal moved first.",
         "rlwatch_env_reward_mean: one environment or all."],
        ["Stop and resume from the last checkpoint at or before the peak (`rlwatch postmortem` names it) with "
         "the learning rate halved or the KL coefficient raised."]),
    example=StepExample(series=with_step(50, reward_mean={(): [0.1 + 0.02 * i for i in range(30)] + const(0.3, 20)}),
                        fires_at=37, labels={"signal": "reward_mean"}, value=0.3),
)

PRECURSORS = Alert(
    name="RLWatchCollapsePrecursors", severity="critical", for_steps=1,
    value_format="{:.0f} precursors raised within precursor_steps",
    params=("precursor_steps", "clear_steps"),
    summary="Several collapse precursors moved together.",
    description="Run {{ $labels.run }}: {{ $value }} different precursors (entropy, policy KL, gradient norm, "
                "length, reward) raised within a few steps.",
    windows="Two different precursor conditions (those of RLWatchEntropySurge, RLWatchPolicyKLDeparture, "
            "RLWatchGradNormSpike, RLWatchGradNormDead, RLWatchLengthRunaway, RLWatchRewardSlide) raised within "
            "`precursor_steps` logged rows of their signals; holds while one did.",
    condition=_precursors,
    runbook=_runbook(
        "One precursor alone is often noise; two moving together are how real runs collapse: the policy KL or "
        "the entropy departs, the gradient spikes or dies, the length runs away, then the reward falls.",
        ["A learning rate too high for this stage of the run.", "A reward hack being exploited.",
         "A numerics problem (non-finite gradients)."],
        ["The warnings that fired with it (the precursors) and their first steps.", "`rlwatch postmortem`."],
        ["Checkpoint now (the guard can do this).", "Lower the learning rate and raise the KL coefficient.",
         RESUME]),
    example=StepExample(series=with_step(50, entropy_mean={(): [0.5, 0.52] * 20 + const(1.2, 10)},
                                         policy_kl={(): [0.02, 0.025] * 20 + const(0.25, 10)}),
                        fires_at=42, labels={}, value=2.0),
)

#: The domain's alerts, in page order; the combination is judged last, after the precursors of its step.
ALERTS: tuple[Alert, ...] = (GRAD_DEAD, ENTROPY_SURGE, POLICY_KL, GRAD_SPIKE, LENGTH_RUNAWAY, REWARD_SLIDE,
                             PRECURSORS)

__all__ = ["ALERTS", "PARAMS"]
