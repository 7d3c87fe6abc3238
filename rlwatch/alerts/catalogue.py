"""The alert catalogue: every alert rlwatch ships, in one place, and the paging policy it enforces.

Paging policy (stated in ``alerts/runbook.md``):

- **critical** means a person should act now. Only these are critical: a collapse predictor at a
  magnitude that matters (k3 sustained above an absolute bound, importance weights degenerate, the
  lag far beyond the configured bound), a sampler-semantics fault at the start of an on-policy run,
  a reward-hack rate that is both high and rising with statistical evidence, a stopped trainer and a
  crashed exporter.
- **warning** is everything relative: jumps against a run's own baseline, drifts, rates that are
  high but not yet a reason to stop. A relative condition never pages on its own.
- **Evidence before alarm.** No rising or jump condition without a baseline of ``baseline_steps``
  steps; rates are judged by their Wilson lower confidence bound (3 of 40 flagged is not evidence
  of a rate above 5%); the on-policy check subtracts ``evidence_z`` standard errors of the mean
  log-ratio; magnitudes must hold ``for_steps`` consecutive steps.
- **One incident, one page.** An alert opens after ``for_steps`` steps of its raise condition and
  stays open while its (looser) hold condition holds and for ``clear_steps`` steps after it last
  held; a fault that persists keeps its alert firing.

One verdict everywhere: the step-window statistics (baselines, rate bounds, standard errors,
streaks, the steps since an alert's condition last held) are computed once per step in the
training process (:mod:`rlwatch.alerts.windows`) and exported as ``rlwatch_alert_value``,
``rlwatch_alert_streak_steps``, ``rlwatch_alert_quiet_steps``, ``rlwatch_window_baseline`` and
``rlwatch_window_stderr``. The Prometheus rules compare those exported values with the run's
thresholds, and the embedded evaluator makes the same comparison on the same numbers, so the two
fire the same alerts at the same steps whatever the time between steps. Only the wall-clock alerts
(trainer stalled, exporter down, hook errors, the watchdog) are evaluated on time.

Thresholds (:data:`PARAMS`) are defaults; a run overrides any of them with
``Watch(alert_overrides={...})``, which the step windows use and which is exported as
``rlwatch_alert_threshold{param=...}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

#: the runbook every rlwatch exporter serves (the copy shipped in the package); RLWATCH_RUNBOOK_URL
#: overrides it (runbook_base)
RUNBOOK_BASE = "http://127.0.0.1:9400/runbook"


def runbook_base(explicit: str | None = None) -> str:
    """The runbook's base URL: ``explicit``, else $RLWATCH_RUNBOOK_URL, else :data:`RUNBOOK_BASE`."""
    from ..config import runbook_url

    return runbook_url(explicit, RUNBOOK_BASE)


@dataclass(frozen=True)
class Param:
    default: float
    doc: str


PARAMS: dict[str, Param] = {
    "kl_k3_max": Param(0.1, "k3 = KL(mu||pi_old) above which a step counts toward a spike. verl's rollout-correction "
                       "guidance treats |KL| > 0.1 as unhealthy; bf16 numeric mismatch alone gives ~1e-3."),
    "kl_jump_factor": Param(5.0, "k3 this many times its trailing baseline mean is a jump (a warning)."),
    "kl_jump_floor": Param(0.01, "No jump while k3 stays below this (a jump from 1e-5 to 1e-4 is noise)."),
    "drift_score_max": Param(8.0, "CUSUM drift score (in robust standard deviations) above which a signal "
                             "is drifting (a warning)."),
    "onpolicy_log_ratio_max": Param(0.02, "|mean signed log-ratio| allowed in the first steps of an on-policy "
                                    "run, beyond evidence_z standard errors; numeric noise is zero-mean, a "
                                    "semantics bug is not."),
    "onpolicy_steps": Param(5.0, "Steps counted as the start of the run for the on-policy check."),
    "staleness_over_bound_max": Param(0.0, "Fraction of tokens allowed above the staleness bound."),
    "lag_critical_factor": Param(2.0, "Maximum lag above this many times the staleness bound is critical."),
    "tis_truncated_max": Param(0.05, "Fraction of tokens a TIS cap truncates (w > C), judged by its lower "
                               "confidence bound."),
    "ess_min": Param(0.3, "Normalised effective sample size below which IS weights are degenerate "
                     "(verl flags ESS < 0.3)."),
    "zero_variance_max": Param(0.5, "Fraction of GRPO groups that are all-pass or all-fail (lower bound over "
                               "the last 5 steps' groups)."),
    "truncated_max": Param(0.2, "Fraction of responses cut by the length limit or a timeout (lower bound over "
                           "the last 5 steps' responses)."),
    "hack_ratio_max": Param(0.1, "Fraction of an environment's episodes a reward-hack detector flags, judged by "
                            "the lower confidence bound over the last 10 steps."),
    "hack_jump_factor": Param(2.0, "To open, the hack rate's lower bound must also exceed this many times the "
                              "environment's own rate before the window."),
    "hack_baseline_steps": Param(5.0, "Steps with judged episodes needed before the window for the hack "
                                 "rate to count as rising."),
    "failure_ratio_max": Param(0.05, "Fraction of an environment's episodes failing for infrastructure reasons "
                               "(lower confidence bound)."),
    "entropy_collapse_ratio": Param(0.2, "Entropy below this fraction of its own maximum over the last 120 "
                                    "steps."),
    "stall_seconds": Param(900.0, "Seconds without a new step before the trainer counts as stalled."),
    "nonfinite_ratio_max": Param(0.001, "Fraction of response tokens with a NaN or infinite log-prob (lower "
                                 "confidence bound)."),
    "baseline_steps": Param(20.0, "Steps a trailing baseline needs before any jump or collapse-relative "
                            "condition can hold."),
    "evidence_z": Param(2.33, "Standard normal quantile of the evidence bars: Wilson lower bounds of rates and "
                        "standard errors of means (2.33: one-sided 99%)."),
    "hold_fraction": Param(0.5, "An open alert holds while its statistic stays beyond this fraction of the "
                           "raise threshold (hysteresis; 0.8 let k3 hovering around the bound re-page on the "
                           "tuning split)."),
    "clear_steps": Param(15.0, "Steps without the hold condition before an open alert resolves: a fault that "
                         "comes back within them is the same incident (10 left re-pages on the tuning split)."),
}


def threshold(param: str) -> str:
    """PromQL for the per-run value of ``param``: the run's exported override, else the default."""
    return (f'(rlwatch_alert_threshold{{param="{param}"}} or on(run) '
            f'(0 * rlwatch_step + {PARAMS[param].default:g}))')


def wilson_lower(k: float, n: float, z: float) -> float:
    """Wilson score lower confidence bound of a binomial rate (k successes in n trials); 0 when n = 0."""
    if n <= 0:
        return 0.0
    p = min(1.0, max(0.0, k / n))
    denom = 1.0 + z * z / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(max(0.0, p * (1 - p) / n + z * z / (4 * n * n)))
    return max(0.0, (centre - margin) / denom)


# --- the step windows' view of the run ----------------------------------------------------------

LabelSet = dict[str, str]
#: One alert's reading of one step: {label values: (value, raise, hold)}.
Verdicts = dict[tuple[str, ...], tuple[float, bool, bool]]


class History:
    """The last steps' values ({metric name: {label values: value}}) and the thresholds in force."""

    def __init__(self, steps: list[tuple[int, dict]], params: dict[str, float]) -> None:
        self.steps = steps
        self.params = params
        self.stats: dict[tuple[str, str], float] = {}     # (kind, signal) -> window statistic, exported

    def p(self, name: str) -> float:
        return self.params.get(name, PARAMS[name].default)

    @property
    def step(self) -> int | None:
        return self.steps[-1][0] if self.steps else None

    def latest(self, name: str, labels: tuple[str, ...] = ()) -> float | None:
        if not self.steps:
            return None
        v = self.steps[-1][1].get(name, {}).get(labels)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v

    def family(self, name: str) -> dict[tuple[str, ...], float]:
        if not self.steps:
            return {}
        return {k: v for k, v in self.steps[-1][1].get(name, {}).items() if v is not None and v == v}

    def window(self, name: str, labels: tuple[str, ...], last: int, skip: int = 0) -> list[float]:
        """Values of one series over the ``last`` steps that end ``skip`` steps before the latest."""
        end = len(self.steps) - skip
        chosen = self.steps[max(0, end - last):max(0, end)]
        return [v for _, values in chosen if (v := values.get(name, {}).get(labels)) is not None and v == v]

    def increments(self, name: str, last: int, skip: int = 0) -> dict[tuple[str, ...], float]:
        """Counter increments summed per label set over the ``last`` steps ending ``skip`` before the latest."""
        end = len(self.steps) - skip
        out: dict[tuple[str, ...], float] = {}
        for _, values in self.steps[max(0, end - last):max(0, end)]:
            for labels, v in values.get(name, {}).items():
                if v:
                    out[labels] = out.get(labels, 0.0) + v
        return out

    def steps_with(self, name: str, labels: tuple[str, ...], last: int, skip: int = 0) -> int:
        end = len(self.steps) - skip
        return sum(1 for _, values in self.steps[max(0, end - last):max(0, end)] if values.get(name, {}).get(labels))


@dataclass(frozen=True)
class Runbook:
    meaning: str
    causes: list[str]
    look: list[str]
    do: list[str]


@dataclass(frozen=True)
class Example:
    """Series sampled once a minute in which a Prometheus-only alert fires at minute ``fires_at``
    with ``labels``; None in a series is a missing sample."""

    series: dict[str, list[float | None]]
    fires_at: int
    labels: LabelSet
    value: float


@dataclass(frozen=True)
class StepExample:
    """A step-window alert's example: per-step rlwatch values ({metric: {label values: [value per
    step, None = missing]}}, counters as per-step increments) in which the alert opens at step
    ``fires_at`` with ``labels`` (run excluded) and ``value``."""

    series: dict[str, dict[tuple[str, ...], list[float | None]]]
    fires_at: int
    labels: LabelSet
    value: float

    @property
    def length(self) -> int:
        return max(len(v) for family in self.series.values() for v in family.values())

    def steps(self) -> list[tuple[int, dict]]:
        out: list[tuple[int, dict]] = [(i, {}) for i in range(self.length)]
        for name, family in self.series.items():
            for labels, values in family.items():
                for i, v in enumerate(values):
                    if v is not None:
                        out[i][1].setdefault(name, {})[labels] = v
        return out


#: Label names of the exported alert statistics, in order; unused ones are "".
ALERT_LABELS: tuple[str, ...] = ("alert", "signal", "env", "detector", "kind")


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    summary: str
    description: str
    runbook: Runbook
    windows: str
    condition: Callable[[History], Verdicts] | None = None
    for_steps: int = 1
    prom_expr: str = ""
    for_minutes: int = 0
    keep_firing_minutes: int = 0
    example: Example | StepExample | None = None
    embedded_note: str = ""
    params: tuple[str, ...] = ()
    labels: tuple[str, ...] = ("run",)

    @property
    def step_labels(self) -> tuple[str, ...]:
        """The alert's labels other than run, in the order of its verdict keys."""
        return tuple(label for label in self.labels if label != "run")

    @property
    def expr(self) -> str:
        if self.condition is None:
            return self.prom_expr
        on = ", ".join(("run",) + ALERT_LABELS[1:])
        return (f'max without (alert) (rlwatch_alert_value{{alert="{self.name}"}})\n'
                f'and on({on})\n'
                f'(rlwatch_alert_quiet_steps{{alert="{self.name}"}} < on(run) group_left() '
                f"{threshold('clear_steps')})")

    @property
    def runbook_url(self) -> str:
        return f"{runbook_base()}#{self.name.lower()}"

    @property
    def group(self) -> str:
        return "rlwatch-" + ("health" if self.condition is None else "signals")


# --- conditions --------------------------------------------------------------------------------

def _one(value: float | None, raise_: bool, hold: bool) -> Verdicts:
    return {} if value is None else {(): (value, raise_, hold)}


def _kl_spike(h: History) -> Verdicts:
    k3, bound = h.latest("mismatch_kl_k3"), h.p("kl_k3_max")
    return _one(k3, k3 is not None and k3 > bound, k3 is not None and k3 > h.p("hold_fraction") * bound)


def _kl_jump(h: History) -> Verdicts:
    k3 = h.latest("mismatch_kl_k3")
    if k3 is None:
        return {}
    base = h.window("mismatch_kl_k3", (), last=30, skip=5)
    floor = h.p("kl_jump_floor")
    if len(base) < max(2.0, h.p("baseline_steps")):        # a standard deviation needs 2 steps
        return _one(k3, False, k3 > floor)
    mean = sum(base) / len(base)
    sd = math.sqrt(sum((v - mean) ** 2 for v in base) / (len(base) - 1))
    band = h.p("evidence_z") * sd * math.sqrt(1 + 1 / len(base))      # prediction interval of one step
    h.stats[("baseline", "mismatch_kl_k3")] = mean
    h.stats[("stderr", "mismatch_kl_k3")] = sd
    raise_ = k3 > floor and k3 > h.p("kl_jump_factor") * mean and k3 > mean + band
    return _one(k3, raise_, k3 > floor and k3 > mean + band)


DRIFT_SIGNALS = ("mismatch_kl_k3", "mismatch_abs_log_ratio_p99")


def _mismatch_drift(h: History) -> Verdicts:
    out: Verdicts = {}
    bound = h.p("drift_score_max")
    for (signal, _env, _detector), score in h.family("drift_score").items():
        if signal in DRIFT_SIGNALS:
            out[(signal,)] = (score, score > bound, score > h.p("hold_fraction") * bound)
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
    return _one(abs(mean), start and evidence > bound, not lag and evidence > 0)


def _lag_far(h: History) -> Verdicts:
    lag, bound = h.latest("version_lag_max"), h.latest("staleness_bound")
    if lag is None or bound is None:
        return {}
    return _one(lag, lag > h.p("lag_critical_factor") * bound, lag > bound)


def _rate(num: str, den: str, last: int, param: str, den_labels: Callable[[tuple], tuple]
          ) -> Callable[[History], Verdicts]:
    """A counter ratio over the last ``last`` steps: opens when its Wilson lower bound exceeds the
    threshold, holds while the point estimate stays above ``hold_fraction`` of it."""
    def condition(h: History) -> Verdicts:
        nums, dens = h.increments(num, last), h.increments(den, last)
        out: Verdicts = {}
        bound, z = h.p(param), h.p("evidence_z")
        for labels, k in nums.items():
            d = dens.get(den_labels(labels))
            if d:
                lower = wilson_lower(k, d, z)
                out[labels] = (k / d, lower > bound, k / d > h.p("hold_fraction") * bound)
        return out
    return condition


def _gauge_rate(ratio: str, total: str, last: int, param: str, kinds: tuple[str, ...] | None = None
                ) -> Callable[[History], Verdicts]:
    """A per-step ratio gauge pooled over the last ``last`` steps, weighted by the ``total`` gauge."""
    def condition(h: History) -> Verdicts:
        out: Verdicts = {}
        bound, z = h.p(param), h.p("evidence_z")
        for labels in h.family(ratio):
            if kinds is not None and labels[0] not in kinds:
                continue
            k = n = 0.0
            for _, values in h.steps[-last:]:
                r, t = values.get(ratio, {}).get(labels), values.get(total, {}).get(())
                if r is not None and t:
                    k, n = k + r * t, n + t
            if n:
                out[labels] = (k / n, wilson_lower(k, n, z) > bound, k / n > h.p("hold_fraction") * bound)
        return out
    return condition


def _ess_low(h: History) -> Verdicts:
    ess, bound = h.latest("is_ess_ratio"), h.p("ess_min")
    return _one(ess, ess is not None and ess < bound, ess is not None and ess < bound / h.p("hold_fraction"))


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


def _entropy_collapse(h: History) -> Verdicts:
    e = h.latest("entropy_mean")
    recent = h.window("entropy_mean", (), last=120, skip=1)
    if e is None or not recent or len(recent) < h.p("baseline_steps"):
        return {}
    top = max(recent)
    h.stats[("baseline", "entropy_mean")] = top
    ratio = h.p("entropy_collapse_ratio")
    return _one(e, e < ratio * top, e < ratio * top / h.p("hold_fraction"))


def _seconds_since_step(h: History, now: float) -> list[tuple[LabelSet, float]]:
    last = h.latest("last_step_timestamp_seconds")
    if last is None:
        return []
    idle = now - last
    return [({}, idle)] if idle > h.p("stall_seconds") else []


# --- examples -------------------------------------------------------------------------------------

def _const(value: float, n: int) -> list[float]:
    return [value] * n


def _cumulative(increments: list[float]) -> list[float]:
    out, total = [], 0.0
    for inc in increments:
        total += inc
        out.append(total)
    return out


def _steps(n: int) -> list[float]:
    return [float(i) for i in range(n)]


def _with_step(n: int, **families: dict) -> dict:
    return {"step": {(): _steps(n)}, **families}


_R = 'run="r1"'

# --- the catalogue --------------------------------------------------------------------------------

ALERTS: tuple[Alert, ...] = (
    Alert(
        name="RLWatchKLSpike", severity="critical", for_steps=2,
        params=("kl_k3_max", "hold_fraction", "clear_steps"),
        summary="Sampler-learner KL is above the absolute bound.",
        description=("Run {{ $labels.run }}: k3 = KL(mu||pi_old) is {{ $value | printf \"%.4g\" }}, above the "
                     "absolute bound for consecutive steps."),
        windows="k3 above `kl_k3_max` for 2 consecutive steps opens it; it holds while k3 stays above "
                "`hold_fraction` x the bound. A relative jump without that magnitude is RLWatchKLJump, a warning.",
        condition=_kl_spike,
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
        example=StepExample(series=_with_step(13, mismatch_kl_k3={(): _const(0.002, 10) + _const(0.3, 3)}),
                            fires_at=11, labels={}, value=0.3),
    ),
    Alert(
        name="RLWatchKLJump", severity="warning", for_steps=2,
        params=("kl_jump_factor", "kl_jump_floor", "baseline_steps", "evidence_z", "clear_steps"),
        summary="Sampler-learner KL jumped above its own baseline.",
        description=("Run {{ $labels.run }}: k3 = {{ $value | printf \"%.4g\" }} is several times its trailing "
                     "baseline and outside the baseline's step-to-step spread, but below the absolute bound."),
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
        example=StepExample(series=_with_step(32, mismatch_kl_k3={(): [0.002, 0.003] * 15 + [0.05, 0.06]}),
                            fires_at=31, labels={}, value=0.06),
    ),
    Alert(
        name="RLWatchMismatchDrift", severity="warning", for_steps=1,
        params=("drift_score_max", "hold_fraction", "clear_steps"),
        labels=("run", "signal"),
        summary="Sampler-learner mismatch is drifting up.",
        description=("Run {{ $labels.run }}: {{ $labels.signal }} has drifted above its own baseline (drift score "
                     "{{ $value | printf \"%.4g\" }})."),
        windows="The drift score rlwatch computes per step (a CUSUM of robust z-scores against a trailing "
                "baseline, no score before 15 steps) above `drift_score_max`.",
        condition=_mismatch_drift,
        runbook=Runbook(
            meaning="k3 or the 99th percentile of |log pi_old - log mu| has risen steadily relative to this "
                    "run's own history. In the reference experiment the mismatch told of the collapse long "
                    "before the reward did.",
            causes=["Staleness creeping up in an asynchronous pipeline.",
                    "The policy sharpening (entropy falling) so that each update moves it further.",
                    "A slow change in the sampler (engine preemption and recomputation under memory pressure)."],
            look=["The drift score's signal label, and the same signal in the sampler-learner mismatch row of the rlwatch / details dashboard.",
                  "rlwatch_version_lag_mean and rlwatch_entropy_mean over the same window.",
                  "vLLM's preemption counter next to the mismatch (rollout-engine row)."],
            do=["Watch for a KL spike; consider lowering the learning rate or tightening the staleness bound.",
                "Make sure a behaviour correction (TIS/MIS) is on before the drift turns into a spike."]),
        example=StepExample(series=_with_step(12, drift_score={("mismatch_abs_log_ratio_p99", "", ""):
                                                                _const(0.0, 10) + [3.0, 9.5]}),
                            fires_at=11, labels={"signal": "mismatch_abs_log_ratio_p99"}, value=9.5),
    ),
    Alert(
        name="RLWatchOnPolicyRatioNotOne", severity="critical", for_steps=1,
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
        example=StepExample(series=_with_step(3, mismatch_log_ratio_mean={(): [0.001, 0.0005, -0.3]},
                                              mismatch_kl_k2={(): [1e-4, 1e-4, 0.05]},
                                              mismatch_tokens={(): _const(1000.0, 3)},
                                              version_lag_max={(): _const(0.0, 3)}),
                            fires_at=2, labels={}, value=0.3),
    ),
    Alert(
        name="RLWatchStalenessBoundExceeded", severity="warning", for_steps=3,
        params=("staleness_over_bound_max", "evidence_z", "clear_steps"),
        summary="Tokens older than the staleness bound are being trained on.",
        description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of tokens exceed the staleness "
                     "bound."),
        windows="Tokens over the bound / tokens over the last 10 steps (Wilson lower bound), 3 steps running.",
        condition=_rate("tokens_over_staleness_bound_total", "tokens_total", 10, "staleness_over_bound_max",
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
        example=StepExample(series=_with_step(30, tokens_over_staleness_bound_total={(): _const(0.0, 20) +
                                                                                     _const(50.0, 10)},
                                              tokens_total={(): _const(1000.0, 30)}),
                            fires_at=22, labels={}, value=0.015),
    ),
    Alert(
        name="RLWatchVersionLagFarAboveBound", severity="critical", for_steps=2,
        params=("lag_critical_factor", "clear_steps"),
        summary="Maximum version lag is far above the staleness bound.",
        description=("Run {{ $labels.run }}: the oldest token trained is {{ $value }} updates stale."),
        windows="The maximum lag above `lag_critical_factor` x the staleness bound for 2 steps; holds while "
                "it stays above the bound.",
        condition=_lag_far,
        runbook=Runbook(
            meaning="Some data is many updates older than the pipeline allows. In the reference experiment "
                    "lag 8 without correction destroyed the skill while lag 2 was harmless.",
            causes=["Weight sync not happening: the lag grows by one every step (trl#5312).",
                    "A stuck rollout worker whose episodes finish much later.",
                    "A replay buffer that keeps old episodes."],
            look=["Does rlwatch_version_lag_max grow linearly with rlwatch_trainer_version? Then sync is broken.",
                  "rlwatch_mismatch_kl_k3 over the same window."],
            do=["Fix the weight sync or restart the rollout workers.",
                "Enforce the staleness bound at consumption."]),
        example=StepExample(series=_with_step(4, version_lag_max={(): [1.0, 2.0, 9.0, 9.0]},
                                              staleness_bound={(): _const(4.0, 4)}),
                            fires_at=3, labels={}, value=9.0),
    ),
    Alert(
        name="RLWatchISTruncationHigh", severity="warning", for_steps=3,
        params=("tis_truncated_max", "evidence_z", "hold_fraction", "clear_steps"),
        summary="Many tokens have an importance weight above the TIS cap.",
        description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of tokens have pi_old/mu above "
                     "the cap C."),
        windows="Truncated tokens / tokens over the last 10 steps, Wilson lower bound above the threshold, 3 "
                "steps running.",
        condition=_rate("is_tis_truncated_tokens_total", "mismatch_tokens_total", 10, "tis_truncated_max",
                        lambda k: k),
        runbook=Runbook(
            meaning="A truncated-IS correction now caps many weights, so it leaves bias behind; read it next to "
                    "the raw mismatch, since a capped fraction alone misleads (in the reference, weights below "
                    "1, not the cap, did the work).",
            causes=["Growing staleness or a sampler change.", "A policy sharpening fast."],
            look=["rlwatch_is_tis_low_ratio and rlwatch_is_ess_ratio.", "rlwatch_mismatch_kl_k3."],
            do=["Reduce staleness; consider MIS (masking) if outliers dominate, or a lower learning rate."]),
        example=StepExample(series=_with_step(30, is_tis_truncated_tokens_total={(): _const(1.0, 20) +
                                                                                 _const(200.0, 10)},
                                              mismatch_tokens_total={(): _const(1000.0, 30)}),
                            fires_at=24, labels={}, value=0.1005),
    ),
    Alert(
        name="RLWatchESSLow", severity="critical", for_steps=2,
        params=("ess_min", "hold_fraction", "clear_steps"),
        summary="Importance-sampling effective sample size is low.",
        description=("Run {{ $labels.run }}: normalised ESS of the truncated weights is "
                     "{{ $value | printf \"%.4g\" }}."),
        windows="ESS below `ess_min` for 2 steps; holds while below `ess_min` / `hold_fraction`.",
        condition=_ess_low,
        runbook=Runbook(
            meaning="A few tokens carry most of the importance weight: the corrected gradient rests on a "
                    "small part of the batch and its variance explodes (full IS at a large mismatch had 10x "
                    "the squared gradient as variance in the reference's one-step problem).",
            causes=["A large sampler-learner mismatch (see the KL alert).", "Very stale data."],
            look=["rlwatch_mismatch_chi2_token (ESS ~ 1/(1+chi2) for raw weights).",
                  "rlwatch_is_tis_high_ratio and rlwatch_is_tis_low_ratio."],
            do=["Treat as a KL spike: checkpoint, find the cause, resume from the last healthy checkpoint."]),
        example=StepExample(series=_with_step(4, is_ess_ratio={(): [0.95, 0.9, 0.2, 0.15]}),
                            fires_at=3, labels={}, value=0.15),
    ),
    Alert(
        name="RLWatchZeroVarianceGroupsHigh", severity="warning", for_steps=5,
        params=("zero_variance_max", "evidence_z", "hold_fraction", "clear_steps"),
        labels=("run", "kind"),
        summary="Many GRPO groups carry no gradient.",
        description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of groups are {{ $labels.kind }}; "
                     "their advantages are all zero."),
        windows="The share of all-pass (all-fail) groups pooled over the last 5 steps' groups, Wilson lower "
                "bound above the threshold, 5 steps running.",
        condition=_gauge_rate("zero_variance_groups_ratio", "groups", 5, "zero_variance_max", ("all_pass", "all_fail")),
        runbook=Runbook(
            meaning="GRPO normalises rewards within a group; a group whose rewards are all equal gets zero "
                    "advantage and teaches nothing. all_pass means the prompts are too easy (or the reward is "
                    "hacked); all_fail means too hard (or the grader is broken).",
            causes=["Curriculum too easy or too hard.", "A reward hack (all_pass) or a grader outage (all_fail).",
                    "Infrastructure failures scored as reward 0 (rllm#710): keep them apart with `failed`."],
            look=["rlwatch_env_hack_ratio and rlwatch_env_failure_ratio.", "Reward per environment."],
            do=["Filter or resample prompts (dynamic sampling); fix the grader; check for hacks."]),
        example=StepExample(series=_with_step(15, zero_variance_groups_ratio={("all_fail",): _const(0.1, 5) +
                                                                              _const(0.9, 10)},
                                              groups={(): _const(32.0, 15)}),
                            fires_at=12, labels={"kind": "all_fail"}, value=0.9),
    ),
    Alert(
        name="RLWatchTruncationRateHigh", severity="warning", for_steps=5,
        params=("truncated_max", "evidence_z", "hold_fraction", "clear_steps"),
        summary="Many responses hit the length limit or a timeout.",
        description="Run {{ $labels.run }}: {{ $value | humanizePercentage }} of responses were truncated.",
        windows="Truncated responses pooled over the last 5 steps, Wilson lower bound above the threshold, 5 "
                "steps running.",
        condition=_gauge_rate("truncated_ratio", "sequences", 5, "truncated_max"),
        runbook=Runbook(
            meaning="Truncated episodes need a reward decision and are not a random subset (the longest "
                    "5% are the hardest); masking them biases training toward short tasks.",
            causes=["Response lengths growing (often before a collapse or a length hack).",
                    "A timeout set too tight for the environment."],
            look=["rlwatch_response_length_p99/max and the per-environment truncation table."],
            do=["Raise the limit or the timeout, or penalise length explicitly; check the length-reward drift."]),
        example=StepExample(series=_with_step(15, truncated_ratio={(): _const(0.05, 5) + _const(0.6, 10)},
                                              sequences={(): _const(256.0, 15)}),
                            fires_at=10, labels={}, value=0.6),
    ),
    Alert(
        name="RLWatchRewardHackRateRising", severity="critical", for_steps=1,
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
        example=StepExample(series=_with_step(30, episodes_hacked_total={("buggy", "verifier"): _const(1.0, 20) +
                                                                         _const(30.0, 10)},
                                              episodes_judged_total={("buggy", "verifier"): _const(100.0, 30)}),
                            fires_at=23, labels={"env": "buggy", "detector": "verifier"}, value=0.126),
    ),
    Alert(
        name="RLWatchInfraFailureRateHigh", severity="warning", for_steps=3,
        params=("failure_ratio_max", "evidence_z", "hold_fraction", "clear_steps"),
        labels=("run", "env", "kind"),
        summary="Episodes fail for infrastructure reasons.",
        description=("Run {{ $labels.run }}, environment {{ $labels.env }}: {{ $value | humanizePercentage }} of "
                     "episodes fail with {{ $labels.kind }}."),
        windows="Failed / all episodes of the environment over the last 10 steps, Wilson lower bound above the "
                "threshold, 3 steps running.",
        condition=_rate("episodes_failed_total", "episodes_total", 10, "failure_ratio_max", lambda k: (k[0],)),
        runbook=Runbook(
            meaning="Containers crash, tests hang or graders error. Failures are not independent of the "
                    "episode: with a constant hazard the longest tenth failed three times as often, so "
                    "dropping them biases training toward short tasks, and scoring them 0 teaches the "
                    "policy to avoid whatever made containers crash.",
            causes=["Worker out-of-memory, container start-up failures, a flaky grader."],
            look=["rlwatch_env_failure_ratio by kind; the environment workers' own logs."],
            do=["Keep failures out of the reward (no gradient), retry them, fix the environment."]),
        example=StepExample(series=_with_step(30, episodes_failed_total={("swe", "timeout"): _const(0.0, 10) +
                                                                         _const(10.0, 20)},
                                              episodes_total={("swe",): _const(100.0, 30)}),
                            fires_at=18, labels={"env": "swe", "kind": "timeout"}, value=0.09),
    ),
    Alert(
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
        example=StepExample(series=_with_step(30, entropy_mean={(): _const(1.0, 25) + _const(0.1, 5)}),
                            fires_at=27, labels={}, value=0.1),
    ),
    Alert(
        name="RLWatchNonFiniteLogProbs", severity="warning", for_steps=3,
        params=("nonfinite_ratio_max", "evidence_z", "hold_fraction", "clear_steps"),
        summary="Log-probs are NaN or infinite.",
        description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of response tokens have a "
                     "non-finite log-prob (excluded from the mismatch signals)."),
        windows="Non-finite tokens / tokens over the last 10 steps, Wilson lower bound above the threshold, 3 "
                "steps running.",
        condition=_rate("nonfinite_tokens_total", "tokens_total", 10, "nonfinite_ratio_max", lambda k: k),
        runbook=Runbook(
            meaning="A -inf sampler log-prob means the sampler reported a token its own truncated distribution "
                    "excluded (top-p/top-k); NaN means a numeric fault in a kernel.",
            causes=["Top-p/top-k truncation in the reported log-probs.", "fp16 overflow, a bad kernel."],
            look=["rlwatch_sampler_top_p/top_k, rlwatch_mismatch_log_ratio_mean."],
            do=["Report untruncated log-probs from the sampler; check precision settings."]),
        example=StepExample(series=_with_step(30, nonfinite_tokens_total={(): _const(0.0, 10) + _const(5.0, 20)},
                                              tokens_total={(): _const(1000.0, 30)}),
                            fires_at=15, labels={}, value=0.003),
    ),
    Alert(
        name="RLWatchTrainerStalled", severity="critical", for_minutes=0,
        prom_expr=f"time() - rlwatch_last_step_timestamp_seconds > on(run) group_left() {threshold('stall_seconds')}",
        params=("stall_seconds",),
        summary="The trainer has not finished a step for too long.",
        description="Run {{ $labels.run }}: no step for {{ $value | humanizeDuration }}.",
        windows="Wall time since the last observed step: Prometheus against time(), the training process in a "
                "watchdog thread every few seconds.",
        embedded_note="evaluated by the watchdog thread, not per step",
        runbook=Runbook(
            meaning="The training loop stopped making progress while the process is alive (the exporter "
                    "still answers).",
            causes=["A collective (NCCL) hang, a dead rollout worker the trainer waits on, a full disk.",
                    "A straggler episode in a synchronous pipeline that never finishes."],
            look=["GPU utilisation, the trainer's own logs, the rollout engine's running/waiting requests."],
            do=["Dump stacks (py-spy), restart the stuck workers, resume from the last checkpoint."]),
        example=Example(series={f"rlwatch_last_step_timestamp_seconds{{{_R}}}": _const(0.0, 17),
                                f"rlwatch_step{{{_R}}}": _const(0.0, 17)},
                        fires_at=16, labels={"run": "r1"}, value=960.0),
    ),
    Alert(
        name="RLWatchExporterDown", severity="critical", for_minutes=1, keep_firing_minutes=2,
        prom_expr=('up{job=~"rlwatch.*"} == 0\n'
                   'and on(job, instance) max_over_time(up{job=~"rlwatch.*"}[1h]) == 1'),
        labels=("job", "instance"),
        summary="An rlwatch exporter that was up stopped answering.",
        description="{{ $labels.instance }} (job {{ $labels.job }}) was scraped and is now down; its run's alerts "
                    "are inhibited.",
        windows="Prometheus only: a target that answered in the last hour and has failed for 1m. Exporters "
                "register through file_sd and remove their file when their run closes cleanly, so a finished "
                "run never pages and a target that never came up is not an outage of a run. keep_firing_for "
                "2m absorbs a scrape that succeeds once in between.",
        embedded_note="Prometheus only",
        runbook=Runbook(
            meaning="The training process died, hung hard, or its metrics endpoint is unreachable. Every "
                    "alert that depends on this exporter is silenced by the Alertmanager inhibition.",
            causes=["The job crashed or was preempted.", "The port moved (port_fallback) or a firewall."],
            look=["The job scheduler; `rlwatch postmortem` on the run store for the last steps it recorded."],
            do=["Restart from the last healthy checkpoint; fix the scrape target."]),
        example=Example(series={'up{job="rlwatch",instance="127.0.0.1:9400"}': [1.0, 1.0, 0.0, 0.0, 0.0],
                                'up{job="rlwatch",instance="127.0.0.1:9401"}': [0.0, 0.0, 0.0, 0.0, 0.0]},
                        fires_at=3, labels={"job": "rlwatch", "instance": "127.0.0.1:9400"}, value=0.0),
    ),
    Alert(
        name="RLWatchHookErrors", severity="warning", for_minutes=9,
        prom_expr="sum by (run, stage, kind) (rate(rlwatch_hook_errors_total[10m])) > 0",
        labels=("run", "stage", "kind"),
        summary="rlwatch is discarding bad input or failing to export.",
        description=("Run {{ $labels.run }}: rlwatch errors in stage {{ $labels.stage }} ({{ $labels.kind }}), "
                     "{{ $value | printf \"%.3g\" }}/s. Training continues; some signals are missing."),
        windows="Prometheus only (the hook's own health).",
        embedded_note="Prometheus only; the process logs each kind once",
        runbook=Runbook(
            meaning="The hook caught errors and carried on: a field of the step record is malformed, or an "
                    "exporter or the store failed.",
            causes=["Shapes or dtypes of the tensors passed to observe changed.", "The store's disk is full.",
                    "The Pushgateway or a webhook is down."],
            look=["The training log: rlwatch logs each kind once with the field and what was wrong."],
            do=["Fix the integration or the disk; nothing stops training."]),
        example=Example(series={f'rlwatch_hook_errors_total{{{_R},stage="validate",kind="shape"}}':
                                _cumulative(_const(1.0, 20))},
                        fires_at=10, labels={"run": "r1", "stage": "validate", "kind": "shape"}, value=1 / 60),
    ),
    Alert(
        name="RLWatchWatchdog", severity="none", for_minutes=0,
        prom_expr="vector(1)",
        labels=(),
        summary="Always firing: proves the alerting pipeline works end to end.",
        description="This alert always fires. If it stops arriving, Prometheus or Alertmanager is broken.",
        windows="Prometheus only.",
        embedded_note="Prometheus only",
        runbook=Runbook(
            meaning="A dead man's switch for the alerting pipeline itself.",
            causes=["Its absence means Prometheus, the rules or Alertmanager are down."],
            look=["Prometheus /alerts and Alertmanager status."],
            do=["Route it to a heartbeat receiver that pages when it stops."]),
        example=Example(series={"rlwatch_step{run=\"r1\"}": [0.0, 1.0]}, fires_at=0, labels={}, value=1.0),
    ),
)

BY_NAME: dict[str, Alert] = {a.name: a for a in ALERTS}

#: Recording rules for the dashboards' wall-clock rate panels (the alerts read the step windows).
RECORDING_RULES: tuple[tuple[str, str], ...] = (
    ("run:rlwatch_tokens_over_staleness_bound:ratio_rate10m",
     "sum by (run) (rate(rlwatch_tokens_over_staleness_bound_total[10m]))\n"
     "/ sum by (run) (rate(rlwatch_tokens_total[10m]))"),
    ("run:rlwatch_is_tis_truncated_tokens:ratio_rate10m",
     "sum by (run) (rate(rlwatch_is_tis_truncated_tokens_total[10m]))\n"
     "/ sum by (run) (rate(rlwatch_mismatch_tokens_total[10m]))"),
    ("run:rlwatch_nonfinite_tokens:ratio_rate10m",
     "sum by (run) (rate(rlwatch_nonfinite_tokens_total[10m]))\n/ sum by (run) (rate(rlwatch_tokens_total[10m]))"),
    ("run_env_detector:rlwatch_episodes_hacked:ratio_rate10m",
     "sum by (run, env, detector) (rate(rlwatch_episodes_hacked_total[10m]))\n"
     "/ sum by (run, env, detector) (rate(rlwatch_episodes_judged_total[10m]))"),
    ("run_env_kind:rlwatch_episodes_failed:ratio_rate10m",
     "sum by (run, env, kind) (rate(rlwatch_episodes_failed_total[10m]))\n"
     "/ on(run, env) group_left() sum by (run, env) (rate(rlwatch_episodes_total[10m]))"),
    ("run_env:rlwatch_episodes_truncated:ratio_rate10m",
     "sum by (run, env) (rate(rlwatch_episodes_truncated_total[10m]))\n"
     "/ sum by (run, env) (rate(rlwatch_episodes_total[10m]))"),
)


def evaluate(alert: Alert, history: History) -> Verdicts:
    """The alert's reading of the latest step ({label values: (value, raise, hold)}; NaN values dropped)."""
    if alert.condition is None:
        return {}
    return {labels: verdict for labels, verdict in alert.condition(history).items()
            if verdict[0] is not None and not (isinstance(verdict[0], float) and math.isnan(verdict[0]))}


def stalled(history: History, now: float) -> list[tuple[LabelSet, float]]:
    """The watchdog's reading of RLWatchTrainerStalled at wall time ``now``."""
    return _seconds_since_step(history, now)


def defaults() -> dict[str, float]:
    return {name: p.default for name, p in PARAMS.items()}


def valid_overrides(overrides: Mapping[str, Any],
                    on_invalid: Callable[[str], None] | None = None) -> dict[str, float]:
    """The run's alert overrides that name a parameter of :data:`PARAMS` with a number ({param:
    value}): the one validation of every reader (the exported thresholds, the step windows, the
    evaluator). Each other entry is ignored and described to ``on_invalid(message)``."""
    clean: dict[str, float] = {}
    for name, value in dict(overrides).items():
        try:
            if name not in PARAMS:
                raise KeyError(name)
            clean[name] = float(value)
        except (KeyError, TypeError, ValueError):
            if on_invalid is not None:
                on_invalid(f"ignored alert override {name!r}={value!r} (known: {', '.join(PARAMS)})")
    return clean


def thresholds(overrides: Mapping[str, Any] = (),
               on_invalid: Callable[[str], None] | None = None) -> dict[str, float]:
    """Every parameter's value for a run ({param: value}): the defaults, then the valid overrides."""
    return {**defaults(), **valid_overrides(overrides, on_invalid)}


__all__ = ["ALERTS", "ALERT_LABELS", "BY_NAME", "PARAMS", "RECORDING_RULES", "Alert", "Example", "History",
           "Runbook", "StepExample", "runbook_base", "Verdicts", "defaults", "evaluate", "stalled", "threshold", "thresholds",
           "valid_overrides", "wilson_lower"]
