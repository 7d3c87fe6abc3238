"""Sampler-learner mismatch: KL spikes and jumps, drift, the on-policy ratio check."""

from __future__ import annotations

import math

from ..conditions import latest_past, one
from ..history import History, Verdicts
from ..model import Alert, Param, Runbook, StepExample, const, with_step
from ..template import K3_BASELINE, K3_CONTEXT
from ..trend import k3_trend, run_baseline, smoothed


#: The thresholds only this domain's alerts read (the shared ones: rlwatch.alerts.params.COMMON).
PARAMS: dict[str, Param] = {
    "kl_k3_max": Param(0.1, "k3 = KL(mu||pi_old) above which a step counts toward a spike. verl's rollout-correction "
                       "guidance treats |KL| > 0.1 as unhealthy; bf16 numeric mismatch alone gives ~1e-3.", above=0.0),
    "kl_jump_factor": Param(5.0, "k3 this many times its trailing baseline mean is a jump (a warning).", low=1.0),
    "kl_jump_floor": Param(0.01, "No jump while k3 stays below this (a jump from 1e-5 to 1e-4 is noise)."),
    "kl_departure_factor": Param(8.0, "k3 (its 5-step median) this many times the run's own baseline (its lowest "
                                 "20-step median) pages (RLWatchKLDeparture): language-model runs sit flat near "
                                 "their numerics floor and pass 10x it 150-500 steps before a collapse.", low=1.0),
    "kl_departure_floor": Param(1.5e-3, "No departure page, and no drift warning, while k3's 5-step median stays "
                                "below this (an fp16 run's 1e-5 -> 1e-4 is 10x but harmless).", above=0.0),
    "kl_drift_factor": Param(5.0, "RLWatchMismatchDrift warns only while k3's 5-step median is this many times "
                             "the run baseline (and above kl_departure_floor): the drift score alone fires on "
                             "noise.", low=1.0),
    "drift_score_max": Param(8.0, "CUSUM drift score (in robust standard deviations) above which a signal "
                             "is drifting (a warning).", above=0.0),
    "onpolicy_log_ratio_max": Param(0.02, "|mean signed log-ratio| allowed in the first steps of an on-policy "
                                    "run, beyond evidence_z standard errors; numeric noise is zero-mean, a "
                                    "semantics bug is not."),
    "onpolicy_steps": Param(5.0, "Steps counted as the start of the run for the on-policy check."),
}


DRIFT_SIGNALS = ("mismatch_kl_k3", "mismatch_abs_log_ratio_p99")


def _kl_jump(h: History) -> Verdicts:
    k3 = h.latest("mismatch_kl_k3")
    if k3 is None:
        return {}
    base = h.window("mismatch_kl_k3", (), last=30, skip=5)
    floor = h.p("kl_jump_floor")
    if len(base) < max(2.0, h.p("baseline_steps")):        # a standard deviation needs 2 steps
        return one(k3, False, k3 > floor)
    mean = sum(base) / len(base)
    sd = math.sqrt(sum((v - mean) ** 2 for v in base) / (len(base) - 1))
    band = h.p("evidence_z") * sd * math.sqrt(1 + 1 / len(base))      # prediction interval of one step
    h.stats[("baseline", "mismatch_kl_k3")] = mean
    h.stats[("stderr", "mismatch_kl_k3")] = sd
    raise_ = k3 > floor and k3 > h.p("kl_jump_factor") * mean and k3 > mean + band
    return one(k3, raise_, k3 > floor and k3 > mean + band)


def _departure_bound(h: History, factor: float) -> tuple[float, float] | None:
    """(k3's 5-step median, the bound: the larger of ``factor`` x the run baseline and the floor)."""
    baseline, smooth = run_baseline(h), smoothed(h)
    if baseline is None or smooth is None:
        return None
    return smooth, max(h.p("kl_departure_floor"), factor * baseline)


def _kl_departure(h: History) -> Verdicts:
    k3_trend(h)
    k3, reading = h.latest("mismatch_kl_k3"), _departure_bound(h, h.p("kl_departure_factor"))
    if k3 is None or reading is None:
        return {}
    smooth, bound = reading
    # Above kl_k3_max the fault is RLWatchKLSpike's page: a burst straight past the bound pages once.
    return one(k3, bound < smooth <= h.p("kl_k3_max"), smooth > h.p("hold_fraction") * bound)


def _mismatch_drift(h: History) -> Verdicts:
    out: Verdicts = {}
    bound = h.p("drift_score_max")
    reading = _departure_bound(h, h.p("kl_drift_factor"))
    # A drift score means something only once k3 itself has left its run baseline by kl_drift_factor
    # and the floor: on language-model runs the score alone fires on noise a few times per run.
    elevated = reading is not None and reading[0] > reading[1]
    for (signal, _env, _detector), score in h.family("drift_score").items():
        if signal in DRIFT_SIGNALS:
            out[(signal,)] = (score, score > bound and elevated, score > h.p("hold_fraction") * bound)
    return out


def _onpolicy(h: History) -> Verdicts:
    mean, k2, n = h.latest("mismatch_log_ratio_mean"), h.latest("mismatch_kl_k2"), h.latest("mismatch_tokens")
    if mean is None or not n:
        return {}
    # k2 = mean(r^2)/2, so the per-token variance of r is 2 k2 - mean^2; its mean's standard error:
    se = math.sqrt(max(0.0, 2 * (k2 or 0.0) - mean * mean) / n)
    h.stats[("stderr", "mismatch_log_ratio_mean")] = se
    step, lag = h.latest("step"), h.latest("version_lag_max")
    evidence = abs(mean) - h.p("evidence_z") * se
    bound = h.p("onpolicy_log_ratio_max")
    start = step is not None and step <= h.p("onpolicy_steps") and not lag
    # Holds while the run stays on-policy and the offset stays statistically non-zero: the fault is a
    # setting that does not go away, while its size shrinks as the policy sharpens (fewer uncertain tokens).
    return one(abs(mean), start and evidence > bound, not lag and evidence > 0)


KL_SPIKE = Alert(
    roles=("kl",),
    name="RLWatchKLSpike", severity="critical", for_steps=2, intermittent=True,
    value_format="k3 {:.4g} nats",
    params=("kl_k3_max", "intermittent_hits", "intermittent_steps", "hold_fraction", "clear_steps"),
    summary="Sampler-learner KL is above the absolute bound.",
    description=("Run {{ $labels.run }}: k3 = KL(mu||pi_old) is {{ $value | printf \"%.4g\" }} nats, above the "
                 "absolute bound on consecutive steps or on several of the last steps" + K3_BASELINE + "."),
    windows="k3 above `kl_k3_max` for 2 consecutive steps, or on `intermittent_hits` of the last "
            "`intermittent_steps` steps (a fault on every second or third step), opens it; it holds while k3 "
            "stays above `hold_fraction` x the bound. A relative jump without that magnitude is RLWatchKLJump, "
            "a warning.",
    condition=latest_past("mismatch_kl_k3", "kl_k3_max"),
    runbook=Runbook(
        meaning="The data the trainer learns from now comes from a policy far from the one it trains. "
                "On TinyAgent a behaviour policy 8 updates stale gave a mean |log pi_old - log mu| of 0.70 "
                "nats and destroyed the skill; numeric (bf16) mismatch alone is about 0.03 nats, k3 ~1e-3.",
        causes=["Weight sync failed or was skipped: the sampler still runs old weights (trl#5312).",
                "Staleness grew: the async pipeline let old rollouts through (check the lag panels).",
                "Sampler and trainer compute log-probs differently: temperature, top-p/top-k, logprobs "
                "mode (trl#4159, trl#6789).",
                "A learning-rate or batch change made each update move the policy much further.",
                "A kernel, precision or MoE-router change on one side only."],
        look=["rlwatch_version_lag_max and the lag heatmap: did staleness move first?",
              "rlwatch_mismatch_log_ratio_mean: a constant offset points to semantics, not staleness.",
              "rlwatch_mismatch_abs_log_ratio_by_prob: mismatch on high-probability tokens is not numeric "
              "noise.",
              "rlwatch_diagnosis_info and `rlwatch postmortem` for the likely cause."],
        do=["Pause or checkpoint now (the guard can do this automatically).",
            "If the lag is high: tighten the staleness bound or enforce it at consumption.",
            "Enable truncated IS (TIS, C=2) if the run trains without a behaviour correction.",
            "If the sampler's semantics differ: align temperature/top-p and the logprobs mode, then "
            "restart from the last healthy checkpoint."]),
    example=StepExample(series=with_step(13, mismatch_kl_k3={(): const(0.002, 10) + const(0.3, 3)}),
                        fires_at=11, labels={}, value=0.3),
    more_examples=(StepExample(series=with_step(16, mismatch_kl_k3={(): const(0.002, 10) + [0.8, 0.002] * 3}),
                               fires_at=12, labels={}, value=0.8, case="intermittent"),),
)


KL_JUMP = Alert(
    roles=("kl",),
    name="RLWatchKLJump", severity="warning", for_steps=2,
    value_format="k3 {:.4g} nats",
    params=("kl_jump_factor", "kl_jump_floor", "baseline_steps", "evidence_z", "clear_steps"),
    summary="Sampler-learner KL jumped above its own baseline.",
    description=("Run {{ $labels.run }}: k3 = {{ $value | printf \"%.4g\" }} nats is several times its trailing "
                 "baseline and outside the baseline's step-to-step spread, but below the absolute bound"
                 + K3_CONTEXT + "."),
    windows="Baseline: the mean and standard deviation of k3 over the 30 steps ending 5 steps ago, at "
            "least `baseline_steps` of them. Opens when k3 exceeds the floor, `kl_jump_factor` x the "
            "baseline mean and the mean plus `evidence_z` prediction standard deviations, 2 steps running.",
    condition=_kl_jump,
    runbook=Runbook(
        meaning="The mismatch moved suddenly relative to this run's own history, at a magnitude that does "
                "not yet make the data unusable. A warning: look before it becomes a spike.",
        causes=["A weight sync skipped once, a sampler restart, a learning-rate warm-up ending.",
                "Staleness stepping up in an asynchronous pipeline."],
        look=["rlwatch_version_lag_max and rlwatch_mismatch_log_ratio_mean at the same steps.",
              "rlwatch_window_baseline{signal=\"mismatch_kl_k3\"}: the baseline it was compared with."],
        do=["Nothing yet if it settles; if it keeps rising, treat it as RLWatchKLSpike."]),
    example=StepExample(series=with_step(32, mismatch_kl_k3={(): [0.002, 0.003] * 15 + [0.05, 0.06]}),
                        fires_at=31, labels={}, value=0.06),
)


KL_DEPARTURE = Alert(
    roles=("mismatch",),
    name="RLWatchKLDeparture", severity="critical", for_steps=3,
    value_format="k3 {:.2g} nats",
    params=("kl_departure_factor", "kl_departure_floor", "kl_k3_max", "baseline_steps", "hold_fraction",
            "clear_steps"),
    summary="Sampler-learner KL has left this run's own baseline.",
    description=("Run {{ $labels.run }}: k3 {{ $value | printf \"%.2g\" }} nats" + K3_CONTEXT + "; it left this run's "
                 "baseline, the climb that comes before a collapse."),
    windows="Run baseline: the lowest 20-step median of k3 so far (from `baseline_steps` steps on; it never "
            "follows k3 up). Opens when the 5-step median of k3 exceeds the larger of `kl_departure_factor` x "
            "the run baseline and `kl_departure_floor`, but not `kl_k3_max` (above it RLWatchKLSpike pages), 3 "
            "steps running; holds while it stays above `hold_fraction` x that bound.",
    condition=_kl_departure,
    runbook=Runbook(
        meaning="On language-model runs k3 sits flat near its numerics floor (bf16 ~1e-3, fp16 ~1e-5) for "
                "thousands of steps; before a collapse it passes 10x that floor 150-500 steps before the "
                "reward falls, long before the absolute bound (kl_k3_max). This pages on that departure.",
        causes=["A weight-update or weight-sync bug: the sampler's weights drift from the trainer's.",
                "A sampler engine or kernel regression (a new vLLM/SGLang version, a changed attention kernel).",
                "Staleness growing in an asynchronous pipeline; the policy sharpening under a high learning "
                "rate so that each update moves it further."],
        look=["rlwatch_mismatch_kl_k3 against rlwatch_window_run_baseline on the overview dashboard, and "
              "rlwatch_window_forecast_steps: the steps left to kl_k3_max at this trend.",
              "rlwatch_version_lag_max and rlwatch_mismatch_log_ratio_mean at the same steps.",
              "rlwatch_is_ess_raw_ratio: an ESS falling with it confirms the weights degenerate."],
        do=["Checkpoint now; the reward has not fallen yet.",
            "Compare sampler and trainer versions, weights and kernels; roll back an engine upgrade.",
            "Enable a behaviour correction (TIS/MIS) or lower the learning rate while you investigate."]),
    example=StepExample(series=with_step(40, mismatch_kl_k3={(): [0.001, 0.0012] * 15 + const(0.02, 10)}),
                        fires_at=34, labels={}, value=0.02),
)


MISMATCH_DRIFT = Alert(
    roles=("kl",),
    name="RLWatchMismatchDrift", severity="warning", for_steps=1,
    value_format="drift score {:.4g} robust standard deviations (CUSUM)",
    params=("drift_score_max", "kl_drift_factor", "kl_departure_floor", "hold_fraction", "clear_steps"),
    labels=("run", "signal"),
    summary="Sampler-learner mismatch is drifting up.",
    description=("Run {{ $labels.run }}: {{ $labels.signal }} has drifted above its own baseline (drift score "
                 "{{ $value | printf \"%.4g\" }} robust standard deviations, a CUSUM)" + K3_CONTEXT + "."),
    windows="The drift score rlwatch computes per step (a CUSUM of robust z-scores against a trailing "
            "baseline, no score before 15 steps) above `drift_score_max`, while the 5-step median of k3 is "
            "above the larger of `kl_drift_factor` x the run baseline (see RLWatchKLDeparture) and "
            "`kl_departure_floor`; holds while the score stays above `hold_fraction` x its bound.",
    condition=_mismatch_drift,
    runbook=Runbook(
        meaning="k3 or the 99th percentile of |log pi_old - log mu| has risen steadily relative to this "
                "run's own history. In the Agent RL tutorial's mismatched-sampler experiment (chapter 13, "
                "agent-rl.tacetai.com) the mismatch told of the collapse long "
                "before the reward did.",
        causes=["Staleness creeping up in an asynchronous pipeline.",
                "The policy sharpening (entropy falling) so that each update moves it further.",
                "A slow change in the sampler (engine preemption and recomputation under memory pressure)."],
        look=["The drift score's signal label, and the same signal in the sampler-learner mismatch row of the "
              "rlwatch / details dashboard.",
              "rlwatch_version_lag_mean and rlwatch_entropy_mean over the same window.",
              "vLLM's preemption counter next to the mismatch (rollout-engine row)."],
        do=["Watch for a KL spike; consider lowering the learning rate or tightening the staleness bound.",
            "Make sure a behaviour correction (TIS/MIS) is on before the drift turns into a spike."]),
    example=StepExample(series=with_step(30, drift_score={("mismatch_abs_log_ratio_p99", "", ""):
                                                            const(0.0, 28) + [3.0, 9.5]},
                                         mismatch_kl_k3={(): [0.001, 0.0012] * 12 + const(0.01, 6)}),
                        fires_at=29, labels={"signal": "mismatch_abs_log_ratio_p99"}, value=9.5),
)


ON_POLICY_RATIO_NOT_ONE = Alert(
    roles=("mismatch",),
    name="RLWatchOnPolicyRatioNotOne", severity="critical", for_steps=1,
    value_format="mean log-ratio {:.4g} nats",
    params=("onpolicy_log_ratio_max", "onpolicy_steps", "evidence_z", "clear_steps"),
    summary="On-policy log-ratio is not 1 at the start of the run.",
    description=("Run {{ $labels.run }}: the mean signed log-ratio is {{ $value | printf \"%.4g\" }} nats "
                 "with no stale token; sampler and trainer disagree on what a log-prob is."),
    windows="Opens in the first `onpolicy_steps` steps of a run with no stale token when |mean log-ratio| "
            "minus `evidence_z` standard errors (from k2 and the token count) exceeds the bound; holds, at "
            "any step, while no token is stale and the mean stays `evidence_z` standard errors from 0 (the "
            "fault is a setting: its size shrinks as the policy sharpens, it does not go away).",
    condition=_onpolicy,
    runbook=Runbook(
        meaning="With identical weights, pi_old/mu should be 1 up to zero-mean numeric noise. A mean "
                "offset in the first steps means the two sides compute different distributions.",
        causes=["Temperature applied on one side only (trl#4159: first-token ratio exactly 2.0 at T=0.6).",
                "Top-p/top-k truncation in the sampler's reported log-probs: every ratio is biased by the log "
                "of the kept mass (trl#6789).",
                "Logprobs mode: raw vs processed log-probs (vLLM's logprobs_mode).",
                "Weights not synced before the first rollout.",
                "Different micro-batch sizes between log-prob passes (verl#2088)."],
        look=["rlwatch_sampler_temperature / top_p / sampler_info against the trainer's settings.",
              "rlwatch_step_nonfinite_tokens: -inf sampler log-probs point to top-p masking.",
              "rlwatch_mismatch_abs_log_ratio_by_prob: a temperature mismatch grows with |log mu|."],
        do=["Stop the run: every step trains on a biased gradient.",
            "Make the sampler report log-probs of the distribution the trainer computes (same temperature, "
            "no truncation, processed logprobs), or recompute them in the trainer."]),
    example=StepExample(series=with_step(3, mismatch_log_ratio_mean={(): [0.001, 0.0005, -0.3]},
                                         mismatch_kl_k2={(): [1e-4, 1e-4, 0.05]},
                                         mismatch_tokens={(): const(1000.0, 3)},
                                         version_lag_max={(): const(0.0, 3)}),
                        fires_at=2, labels={}, value=0.3),
)


#: The domain's alerts, in page order.
ALERTS: tuple[Alert, ...] = (KL_SPIKE, KL_DEPARTURE, KL_JUMP, MISMATCH_DRIFT, ON_POLICY_RATIO_NOT_ONE)


__all__ = ["ALERTS", "PARAMS", "KL_DEPARTURE", "KL_SPIKE", "KL_JUMP", "MISMATCH_DRIFT", "ON_POLICY_RATIO_NOT_ONE"]
