"""The alert catalogue: every alert rlwatch ships, in one place.

Each :class:`Alert` carries its Prometheus expression and the equivalent step-window condition for
the embedded evaluator, side by side, with its severity, ``for`` duration, summary, description,
runbook section and a worked example. From this module come ``alerts/rlwatch-rules.yaml``, the
promtool tests, ``alerts/runbook.md`` and the in-process evaluator (see ``rlwatch.alerts.render``).

Time windows and step windows: Prometheus evaluates over wall-clock windows, the embedded
evaluator over the last N observed steps. Each alert states how the two read its condition; they
coincide when one step is observed per minute (the examples and the tests use that cadence).
A window ``[Wm]`` on a gauge reads the samples of the last W minutes (W + 1 samples, both ends
included in Prometheus 2.x); a rate ratio over ``[Wm]`` reads the increments of the last W steps.

Thresholds (:data:`PARAMS`) are defaults grounded in the reference text and in the frameworks'
own health bounds. A run overrides any of them with ``Watch(alert_overrides={...})``; the Watch
exports the values in force as ``rlwatch_alert_threshold{param=...}`` and every rule reads that
series, falling back to the default for runs that export none, so no rule file is edited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

#: the runbook every rlwatch exporter serves (the copy shipped in the package); RLWATCH_RUNBOOK_URL
#: overrides it (rlwatch.alerts.render.runbook_base)
RUNBOOK_BASE = "http://127.0.0.1:9400/runbook"


@dataclass(frozen=True)
class Param:
    default: float
    doc: str


PARAMS: dict[str, Param] = {
    "kl_k3_max": Param(0.1, "k3 = KL(mu||pi_old) above which a step is a spike. verl's rollout-correction "
                       "guidance treats |KL| > 0.1 as unhealthy; bf16 numeric mismatch alone gives ~1e-3."),
    "kl_jump_factor": Param(5.0, "k3 this many times its own trailing mean is a spike even below kl_k3_max."),
    "kl_jump_floor": Param(0.01, "No jump alert while k3 stays below this (a jump from 1e-5 to 1e-4 is noise)."),
    "drift_score_max": Param(8.0, "CUSUM drift score (in robust standard deviations) above which a signal "
                             "is drifting."),
    "onpolicy_log_ratio_max": Param(0.02, "|mean signed log-ratio| allowed in the first steps of an on-policy "
                                    "run; numeric noise is zero-mean, a semantics bug is not."),
    "onpolicy_steps": Param(5.0, "Steps counted as the start of the run for the on-policy check."),
    "staleness_over_bound_max": Param(0.0, "Fraction of tokens allowed above the staleness bound."),
    "lag_critical_factor": Param(2.0, "Maximum lag above this many times the staleness bound is critical."),
    "tis_truncated_max": Param(0.05, "Fraction of tokens a TIS cap truncates (w > C). On TinyAgent a "
                               "collapsing lag-8 run truncated 3%; 5% is far outside numeric mismatch."),
    "ess_min": Param(0.3, "Normalised effective sample size below which IS weights are degenerate "
                     "(verl flags ESS < 0.3)."),
    "zero_variance_max": Param(0.5, "Fraction of GRPO groups that are all-pass or all-fail."),
    "truncated_max": Param(0.2, "Fraction of responses cut by the length limit or a timeout."),
    "hack_ratio_max": Param(0.1, "Fraction of an environment's episodes a reward-hack detector flags."),
    "hack_jump_factor": Param(2.0, "The hack rate must also exceed this many times its own trailing level."),
    "failure_ratio_max": Param(0.05, "Fraction of an environment's episodes failing for infrastructure reasons."),
    "entropy_collapse_ratio": Param(0.2, "Entropy below this fraction of its own recent maximum."),
    "stall_seconds": Param(900.0, "Seconds without a new step before the trainer counts as stalled."),
    "nonfinite_ratio_max": Param(0.001, "Fraction of response tokens with a NaN or infinite log-prob."),
}


def threshold(param: str) -> str:
    """PromQL for the per-run value of ``param``: the run's exported override, else the default."""
    return (f'(rlwatch_alert_threshold{{param="{param}"}} or on(run) '
            f'(0 * rlwatch_step + {PARAMS[param].default:g}))')


# --- the embedded evaluator's view of the run ---------------------------------------------------

LabelSet = dict[str, str]


class History:
    """The last steps' values ({metric name: {label values: value}}) and the thresholds in force."""

    def __init__(self, steps: list[tuple[int, dict]], params: dict[str, float]) -> None:
        self.steps = steps
        self.params = params

    def p(self, name: str) -> float:
        return self.params.get(name, PARAMS[name].default)

    @property
    def step(self) -> int | None:
        return self.steps[-1][0] if self.steps else None

    def latest(self, name: str, labels: tuple[str, ...] = ()) -> float | None:
        if not self.steps:
            return None
        return self.steps[-1][1].get(name, {}).get(labels)

    def family(self, name: str) -> dict[tuple[str, ...], float]:
        if not self.steps:
            return {}
        return {k: v for k, v in self.steps[-1][1].get(name, {}).items() if v is not None}

    def window(self, name: str, labels: tuple[str, ...], last: int, skip: int = 0) -> list[float]:
        """Values of one series over the ``last`` steps that end ``skip`` steps before the latest."""
        end = len(self.steps) - skip
        chosen = self.steps[max(0, end - last):max(0, end)]
        return [v for _, values in chosen if (v := values.get(name, {}).get(labels)) is not None]

    def increments(self, name: str, last: int) -> dict[tuple[str, ...], float]:
        """Counter increments summed per label set over the last ``last`` steps."""
        out: dict[tuple[str, ...], float] = {}
        for _, values in self.steps[-last:]:
            for labels, v in values.get(name, {}).items():
                if v:
                    out[labels] = out.get(labels, 0.0) + v
        return out


Firing = list[tuple[LabelSet, float]]


@dataclass(frozen=True)
class Runbook:
    meaning: str
    causes: list[str]
    look: list[str]
    do: list[str]


@dataclass(frozen=True)
class Example:
    """Series sampled once a minute (one step per minute) in which the alert fires at minute
    ``fires_at`` with ``labels``; None in a series is a missing sample."""

    series: dict[str, list[float | None]]
    fires_at: int
    labels: LabelSet
    value: float


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    expr: str
    for_minutes: int
    summary: str
    description: str
    runbook: Runbook
    windows: str
    example: Example | None = None
    condition: Callable[[History], Firing] | None = None
    embedded_note: str = ""
    params: tuple[str, ...] = ()
    labels: tuple[str, ...] = ("run",)

    @property
    def for_steps(self) -> int:
        """Consecutive steps the condition must hold (at one step per minute, ``for`` + 1 samples)."""
        return self.for_minutes + 1

    @property
    def runbook_url(self) -> str:
        from .render import runbook_base

        return f"{runbook_base()}#{self.name.lower()}"

    @property
    def group(self) -> str:
        return "rlwatch-" + ("health" if self.name in ("RLWatchExporterDown", "RLWatchWatchdog",
                                                        "RLWatchTrainerStalled", "RLWatchHookErrors")
                             else "signals")


# --- conditions --------------------------------------------------------------------------------

def _above(name: str, param: str) -> Callable[[History], Firing]:
    def condition(h: History) -> Firing:
        v = h.latest(name)
        return [({}, v)] if v is not None and v > h.p(param) else []
    return condition


def _below(name: str, param: str) -> Callable[[History], Firing]:
    def condition(h: History) -> Firing:
        v = h.latest(name)
        return [({}, v)] if v is not None and v < h.p(param) else []
    return condition


def _kl_spike(h: History) -> Firing:
    k3 = h.latest("mismatch_kl_k3")
    if k3 is None:
        return []
    if k3 > h.p("kl_k3_max"):
        return [({}, k3)]
    baseline = h.window("mismatch_kl_k3", (), last=31, skip=5)        # [30m] offset 5m
    if baseline and k3 > h.p("kl_jump_floor") and k3 > h.p("kl_jump_factor") * (sum(baseline) / len(baseline)):
        return [({}, k3)]
    return []


DRIFT_SIGNALS = ("mismatch_kl_k3", "mismatch_abs_log_ratio_p99")


def _mismatch_drift(h: History) -> Firing:
    k3 = h.latest("mismatch_kl_k3")
    if k3 is not None and k3 > h.p("kl_k3_max"):
        return []                                   # the spike alert owns this case
    out = []
    for (signal, env, detector), score in h.family("drift_score").items():
        if signal in DRIFT_SIGNALS and score > h.p("drift_score_max"):
            out.append(({"signal": signal, "env": env, "detector": detector}, score))
    return out


def _onpolicy(h: History) -> Firing:
    step, mean = h.latest("step"), h.latest("mismatch_log_ratio_mean")
    lag = h.latest("version_lag_max")
    if step is None or mean is None or step > h.p("onpolicy_steps") or (lag is not None and lag > 0):
        return []
    return [({}, abs(mean))] if abs(mean) > h.p("onpolicy_log_ratio_max") else []


def _lag_far(h: History) -> Firing:
    lag, bound = h.latest("version_lag_max"), h.latest("staleness_bound")
    if lag is None or bound is None:
        return []
    return [({}, lag)] if lag > h.p("lag_critical_factor") * bound else []


def _counter_ratio(num: str, den: str, last: int, param: str, den_labels: Callable[[tuple], tuple],
                   label_names: tuple[str, ...]) -> Callable[[History], Firing]:
    def condition(h: History) -> Firing:
        nums, dens = h.increments(num, last), h.increments(den, last)
        out = []
        for labels, n in nums.items():
            d = dens.get(den_labels(labels))
            if d and n / d > h.p(param):
                out.append((dict(zip(label_names, labels)), n / d))
        return out
    return condition


def _running_totals(h: History, name: str, key: tuple) -> list[float]:
    """Running totals of a counter's per-step increments over the history (0 before the first step)."""
    out, total = [0.0], 0.0
    for _, values in h.steps:
        total += values.get(name, {}).get(key) or 0.0
        out.append(total)
    return out


def _hack_rising(h: History) -> Firing:
    out = []
    n = len(h.steps)
    for labels in {k for _, values in h.steps[-10:] for k in values.get("episodes_hacked_total", {})}:
        env, detector = labels
        hacked = _running_totals(h, "episodes_hacked_total", labels)
        judged = _running_totals(h, "episodes_judged_total", labels)

        def ratio(end: int) -> float | None:      # the 10-step rate ratio ending at history index end
            d = judged[end] - judged[max(0, end - 10)]
            return (hacked[end] - hacked[max(0, end - 10)]) / d if d else None

        now = ratio(n)
        if now is None or now <= h.p("hack_ratio_max"):
            continue
        # Trailing level: the 10-step ratio as recorded at each minute of [1h] offset 10m.
        past = [r for skip in range(10, 71) if n - skip >= 10 and (r := ratio(n - skip)) is not None]
        if past and now <= h.p("hack_jump_factor") * (sum(past) / len(past)):
            continue
        out.append(({"env": env, "detector": detector}, now))
    return out


def _entropy_collapse(h: History) -> Firing:
    e = h.latest("entropy_mean")
    recent = h.window("entropy_mean", (), last=121)                  # max_over_time([2h])
    if e is None or not recent:
        return []
    return [({}, e)] if e < h.p("entropy_collapse_ratio") * max(recent) else []


def _zero_variance(h: History) -> Firing:
    out = []
    for (kind,), v in h.family("zero_variance_groups_ratio").items():
        if kind in ("all_pass", "all_fail") and v > h.p("zero_variance_max"):
            out.append(({"kind": kind}, v))
    return out


def _seconds_since_step(h: History, now: float) -> Firing:
    last = h.latest("last_step_timestamp_seconds")
    if last is None:
        return []
    idle = now - last
    return [({}, idle)] if idle > h.p("stall_seconds") else []


# --- examples (one step per minute) ---------------------------------------------------------------

def _steps(n: int) -> list[float]:
    return [float(i) for i in range(n)]


def _const(value: float, n: int) -> list[float]:
    return [value] * n


def _cumulative(increments: list[float]) -> list[float]:
    out, total = [], 0.0
    for inc in increments:
        total += inc
        out.append(total)
    return out


_R = 'run="r1"'

# --- the catalogue --------------------------------------------------------------------------------

ALERTS: tuple[Alert, ...] = (
    Alert(
        name="RLWatchKLSpike", severity="critical", for_minutes=0,
        expr=(f"(rlwatch_mismatch_kl_k3 > on(run) group_left() {threshold('kl_k3_max')})\n"
              f"or\n"
              f"(rlwatch_mismatch_kl_k3 > on(run) group_left()\n"
              f"   ({threshold('kl_jump_factor')} * on(run) group_left() "
              f"avg_over_time(rlwatch_mismatch_kl_k3[30m] offset 5m))\n"
              f" and on(run) rlwatch_mismatch_kl_k3 > on(run) group_left() {threshold('kl_jump_floor')})"),
        params=("kl_k3_max", "kl_jump_factor", "kl_jump_floor"),
        summary="Sampler-learner KL spiked.",
        description=("Run {{ $labels.run }}: k3 = KL(mu||pi_old) is {{ $value | printf \"%.4g\" }}, above the "
                     "absolute bound or several times its own trailing mean."),
        windows="Prometheus: the latest k3 against the bound, or against the mean over [30m] ending 5m ago. "
                "Embedded: the latest step against the bound, or against the mean of the 31 steps ending "
                "5 steps before it.",
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
        example=Example(series={f"rlwatch_mismatch_kl_k3{{{_R}}}": _const(0.002, 40) + [0.03, 0.2],
                                f"rlwatch_step{{{_R}}}": _steps(42)},
                        fires_at=40, labels={"run": "r1"}, value=0.03),
    ),
    Alert(
        name="RLWatchMismatchDrift", severity="warning", for_minutes=0,
        expr=(f'rlwatch_drift_score{{signal=~"{"|".join(DRIFT_SIGNALS)}"}} > on(run) group_left() '
              f"{threshold('drift_score_max')}\n"
              f"unless on(run) (rlwatch_mismatch_kl_k3 > on(run) group_left() {threshold('kl_k3_max')})"),
        params=("drift_score_max", "kl_k3_max"),
        labels=("run", "signal"),
        summary="Sampler-learner mismatch is drifting up.",
        description=("Run {{ $labels.run }}: {{ $labels.signal }} has drifted above its own baseline (drift score "
                     "{{ $value | printf \"%.4g\" }}) although no step crossed the spike bound yet."),
        windows="Both read the drift score rlwatch computes per step (a CUSUM of robust z-scores against "
                "a trailing baseline), so the two evaluators see the same number.",
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
        example=Example(series={f'rlwatch_drift_score{{{_R},signal="mismatch_abs_log_ratio_p99"}}':
                                _const(0.0, 10) + [3.0, 9.5],
                                f"rlwatch_mismatch_kl_k3{{{_R}}}": _const(0.01, 12),
                                f"rlwatch_step{{{_R}}}": _steps(12)},
                        fires_at=11, labels={"run": "r1", "signal": "mismatch_abs_log_ratio_p99"},
                        value=9.5),
    ),
    Alert(
        name="RLWatchOnPolicyRatioNotOne", severity="critical", for_minutes=0,
        expr=(f"abs(rlwatch_mismatch_log_ratio_mean) > on(run) group_left() "
              f"{threshold('onpolicy_log_ratio_max')}\n"
              f"and on(run) (rlwatch_step <= on(run) group_left() {threshold('onpolicy_steps')})\n"
              f"unless on(run) (rlwatch_version_lag_max > 0)"),
        params=("onpolicy_log_ratio_max", "onpolicy_steps"),
        summary="On-policy log-ratio is not 1 at the start of the run.",
        description=("Run {{ $labels.run }}: at the start of an on-policy run the mean signed log-ratio is "
                     "{{ $value | printf \"%.4g\" }} nats; sampler and trainer disagree on what a log-prob is."),
        windows="Both: the latest step, while step <= onpolicy_steps and no token is stale.",
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
                  "rlwatch_nonfinite_tokens: -inf sampler log-probs point to top-p masking.",
                  "rlwatch_mismatch_abs_log_ratio_by_prob: a temperature mismatch grows with |log mu|."],
            do=["Stop the run: every step trains on a biased gradient.",
                "Make the sampler report log-probs of the distribution the trainer computes (same temperature, "
                "no truncation, processed logprobs), or recompute them in the trainer."]),
        example=Example(series={f"rlwatch_mismatch_log_ratio_mean{{{_R}}}": [0.001, 0.0005, -0.3],
                                f"rlwatch_version_lag_max{{{_R}}}": [0.0, 0.0, 0.0],
                                f"rlwatch_step{{{_R}}}": _steps(3)},
                        fires_at=2, labels={"run": "r1"}, value=0.3),
    ),
    Alert(
        name="RLWatchStalenessBoundExceeded", severity="warning", for_minutes=2,
        expr=(f"run:rlwatch_tokens_over_staleness_bound:ratio_rate10m > on(run) group_left() "
              f"{threshold('staleness_over_bound_max')}"),
        params=("staleness_over_bound_max",),
        summary="Tokens older than the staleness bound are being trained on.",
        description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of tokens exceed the staleness "
                     "bound."),
        windows="Prometheus: rate ratio over [10m]. Embedded: the increments of the last 10 steps.",
        condition=_counter_ratio("tokens_over_staleness_bound_total", "tokens_total", 10,
                                 "staleness_over_bound_max", lambda k: k, ()),
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
        example=Example(series={f"rlwatch_tokens_over_staleness_bound_total{{{_R}}}":
                                _cumulative(_const(0.0, 20) + _const(50.0, 10)),
                                f"rlwatch_tokens_total{{{_R}}}": _cumulative(_const(1000.0, 30)),
                                f"rlwatch_step{{{_R}}}": _steps(30)},
                        fires_at=22, labels={"run": "r1"}, value=0.015),
    ),
    Alert(
        name="RLWatchVersionLagFarAboveBound", severity="critical", for_minutes=0,
        expr=(f"rlwatch_version_lag_max > on(run) group_left()\n"
              f"  ({threshold('lag_critical_factor')} * on(run) group_left() rlwatch_staleness_bound)"),
        params=("lag_critical_factor",),
        summary="Maximum version lag is far above the staleness bound.",
        description=("Run {{ $labels.run }}: the oldest token trained is {{ $value }} updates stale."),
        windows="Both: the latest step.",
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
        example=Example(series={f"rlwatch_version_lag_max{{{_R}}}": [1.0, 2.0, 9.0],
                                f"rlwatch_staleness_bound{{{_R}}}": _const(4.0, 3),
                                f"rlwatch_step{{{_R}}}": _steps(3)},
                        fires_at=2, labels={"run": "r1"}, value=9.0),
    ),
    Alert(
        name="RLWatchISTruncationHigh", severity="warning", for_minutes=2,
        expr=(f"run:rlwatch_is_tis_truncated_tokens:ratio_rate10m > on(run) group_left() "
              f"{threshold('tis_truncated_max')}"),
        params=("tis_truncated_max",),
        summary="Many tokens have an importance weight above the TIS cap.",
        description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of tokens have pi_old/mu above "
                     "the cap C."),
        windows="Prometheus: rate ratio over [10m]. Embedded: the increments of the last 10 steps.",
        condition=_counter_ratio("is_tis_truncated_tokens_total", "mismatch_tokens_total", 10,
                                 "tis_truncated_max", lambda k: k, ()),
        runbook=Runbook(
            meaning="A truncated-IS correction now caps many weights, so it leaves bias behind; read it next to "
                    "the raw mismatch, since a capped fraction alone misleads (in the reference, weights below "
                    "1, not the cap, did the work).",
            causes=["Growing staleness or a sampler change.", "A policy sharpening fast."],
            look=["rlwatch_is_tis_low_ratio and rlwatch_is_ess_ratio.", "rlwatch_mismatch_kl_k3."],
            do=["Reduce staleness; consider MIS (masking) if outliers dominate, or a lower learning rate."]),
        example=Example(series={f"rlwatch_is_tis_truncated_tokens_total{{{_R}}}":
                                _cumulative(_const(1.0, 20) + _const(200.0, 10)),
                                f"rlwatch_mismatch_tokens_total{{{_R}}}": _cumulative(_const(1000.0, 30)),
                                f"rlwatch_step{{{_R}}}": _steps(30)},
                        fires_at=24, labels={"run": "r1"}, value=0.1005),
    ),
    Alert(
        name="RLWatchESSLow", severity="critical", for_minutes=1,
        expr=f"rlwatch_is_ess_ratio < on(run) group_left() {threshold('ess_min')}",
        params=("ess_min",),
        summary="Importance-sampling effective sample size is low.",
        description=("Run {{ $labels.run }}: normalised ESS of the truncated weights is "
                     "{{ $value | printf \"%.4g\" }}."),
        windows="Both: the latest step, for 2 consecutive steps (for: 1m).",
        condition=_below("is_ess_ratio", "ess_min"),
        runbook=Runbook(
            meaning="A few tokens carry most of the importance weight: the corrected gradient rests on a "
                    "small part of the batch and its variance explodes (full IS at a large mismatch had 10x "
                    "the squared gradient as variance in the reference's one-step problem).",
            causes=["A large sampler-learner mismatch (see the KL alert).", "Very stale data."],
            look=["rlwatch_mismatch_chi2_token (ESS ~ 1/(1+chi2) for raw weights).",
                  "rlwatch_is_tis_high_ratio and rlwatch_is_tis_low_ratio."],
            do=["Treat as a KL spike: checkpoint, find the cause, resume from the last healthy checkpoint."]),
        example=Example(series={f"rlwatch_is_ess_ratio{{{_R}}}": [0.95, 0.9, 0.2, 0.15],
                                f"rlwatch_step{{{_R}}}": _steps(4)},
                        fires_at=3, labels={"run": "r1"}, value=0.15),
    ),
    Alert(
        name="RLWatchZeroVarianceGroupsHigh", severity="warning", for_minutes=4,
        expr=(f'rlwatch_zero_variance_groups_ratio{{kind=~"all_pass|all_fail"}} > on(run) group_left() '
              f"{threshold('zero_variance_max')}"),
        params=("zero_variance_max",),
        labels=("run", "kind"),
        summary="Many GRPO groups carry no gradient.",
        description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of groups are {{ $labels.kind }}; "
                     "their advantages are all zero."),
        windows="Both: the latest step, for 5 consecutive steps (for: 4m).",
        condition=_zero_variance,
        runbook=Runbook(
            meaning="GRPO normalises rewards within a group; a group whose rewards are all equal gets zero "
                    "advantage and teaches nothing. all_pass means the prompts are too easy (or the reward is "
                    "hacked); all_fail means too hard (or the grader is broken).",
            causes=["Curriculum too easy or too hard.", "A reward hack (all_pass) or a grader outage (all_fail).",
                    "Infrastructure failures scored as reward 0 (rllm#710): keep them apart with `failed`."],
            look=["rlwatch_env_hack_ratio and rlwatch_env_failure_ratio.", "Reward per environment."],
            do=["Filter or resample prompts (dynamic sampling); fix the grader; check for hacks."]),
        example=Example(series={f'rlwatch_zero_variance_groups_ratio{{{_R},kind="all_fail"}}':
                                _const(0.1, 5) + _const(0.7, 5),
                                f"rlwatch_step{{{_R}}}": _steps(10)},
                        fires_at=9, labels={"run": "r1", "kind": "all_fail"}, value=0.7),
    ),
    Alert(
        name="RLWatchTruncationRateHigh", severity="warning", for_minutes=4,
        expr=f"rlwatch_truncated_ratio > on(run) group_left() {threshold('truncated_max')}",
        params=("truncated_max",),
        summary="Many responses hit the length limit or a timeout.",
        description="Run {{ $labels.run }}: {{ $value | humanizePercentage }} of responses were truncated.",
        windows="Both: the latest step, for 5 consecutive steps (for: 4m).",
        condition=_above("truncated_ratio", "truncated_max"),
        runbook=Runbook(
            meaning="Truncated episodes need a reward decision and are not a random subset (the longest "
                    "5% are the hardest); masking them biases training toward short tasks.",
            causes=["Response lengths growing (often before a collapse or a length hack).",
                    "A timeout set too tight for the environment."],
            look=["rlwatch_response_length_p99/max and the per-environment truncation table."],
            do=["Raise the limit or the timeout, or penalise length explicitly; check the length-reward drift."]),
        example=Example(series={f"rlwatch_truncated_ratio{{{_R}}}": _const(0.05, 5) + _const(0.4, 5),
                                f"rlwatch_step{{{_R}}}": _steps(10)},
                        fires_at=9, labels={"run": "r1"}, value=0.4),
    ),
    Alert(
        name="RLWatchRewardHackRateRising", severity="critical", for_minutes=0,
        expr=(f"run_env_detector:rlwatch_episodes_hacked:ratio_rate10m > on(run) group_left() "
              f"{threshold('hack_ratio_max')}\n"
              f"unless on(run, env, detector) (\n"
              f"  run_env_detector:rlwatch_episodes_hacked:ratio_rate10m <= on(run) group_left()\n"
              f"  ({threshold('hack_jump_factor')} * on(run) group_left(env, detector)\n"
              f"   avg_over_time(run_env_detector:rlwatch_episodes_hacked:ratio_rate10m[1h] offset 10m)))"),
        params=("hack_ratio_max", "hack_jump_factor"),
        labels=("run", "env", "detector"),
        summary="A reward-hack rate is rising in an environment.",
        description=("Run {{ $labels.run }}, environment {{ $labels.env }}: detector {{ $labels.detector }} flags "
                     "{{ $value | humanizePercentage }} of episodes, up from its own trailing level."),
        windows="Prometheus: rate ratio over [10m] against its mean over [1h] ending 10m ago. Embedded: the "
                "increments of the last 10 steps, against the mean of that ratio at each of the 61 steps "
                "ending 10 steps ago.",
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
        example=Example(series={f'rlwatch_episodes_hacked_total{{{_R},env="buggy",detector="verifier"}}':
                                _cumulative(_const(1.0, 20) + _const(30.0, 10)),
                                f'rlwatch_episodes_judged_total{{{_R},env="buggy",detector="verifier"}}':
                                _cumulative(_const(100.0, 30)),
                                f"rlwatch_step{{{_R}}}": _steps(30)},
                        fires_at=23, labels={"run": "r1", "env": "buggy", "detector": "verifier"}, value=0.126),
    ),
    Alert(
        name="RLWatchInfraFailureRateHigh", severity="warning", for_minutes=4,
        expr=(f"run_env_kind:rlwatch_episodes_failed:ratio_rate10m > on(run) group_left() "
              f"{threshold('failure_ratio_max')}"),
        params=("failure_ratio_max",),
        labels=("run", "env", "kind"),
        summary="Episodes fail for infrastructure reasons.",
        description=("Run {{ $labels.run }}, environment {{ $labels.env }}: {{ $value | humanizePercentage }} of "
                     "episodes fail with {{ $labels.kind }}."),
        windows="Prometheus: rate ratio over [10m], for 4m. Embedded: the increments of the last 10 steps, for "
                "5 consecutive steps.",
        condition=_counter_ratio("episodes_failed_total", "episodes_total", 10, "failure_ratio_max",
                                 lambda k: (k[0],), ("env", "kind")),
        runbook=Runbook(
            meaning="Containers crash, tests hang or graders error. Failures are not independent of the "
                    "episode: with a constant hazard the longest tenth failed three times as often, so "
                    "dropping them biases training toward short tasks, and scoring them 0 teaches the "
                    "policy to avoid whatever made containers crash.",
            causes=["Worker out-of-memory, container start-up failures, a flaky grader."],
            look=["rlwatch_env_failure_ratio by kind; the environment workers' own logs."],
            do=["Keep failures out of the reward (no gradient), retry them, fix the environment."]),
        example=Example(series={f'rlwatch_episodes_failed_total{{{_R},env="swe",kind="timeout"}}':
                                _cumulative(_const(0.0, 10) + _const(10.0, 20)),
                                f'rlwatch_episodes_total{{{_R},env="swe"}}': _cumulative(_const(100.0, 30)),
                                f"rlwatch_step{{{_R}}}": _steps(30)},
                        fires_at=19, labels={"run": "r1", "env": "swe", "kind": "timeout"}, value=0.1),
    ),
    Alert(
        name="RLWatchEntropyCollapse", severity="warning", for_minutes=2,
        expr=(f"rlwatch_entropy_mean < on(run) group_left()\n"
              f"  ({threshold('entropy_collapse_ratio')} * on(run) group_left() "
              f"max_over_time(rlwatch_entropy_mean[2h]))"),
        params=("entropy_collapse_ratio",),
        summary="Policy entropy collapsed.",
        description="Run {{ $labels.run }}: mean token entropy fell to {{ $value | printf \"%.4g\" }} nats.",
        windows="Prometheus: against max_over_time([2h]), for 2m. Embedded: against the maximum of the last 121 "
                "steps, for 3 consecutive steps.",
        condition=_entropy_collapse,
        runbook=Runbook(
            meaning="The policy became nearly deterministic; exploration stops and every update is a larger "
                    "step relative to the data's policy, which amplifies staleness.",
            causes=["Too high a learning rate or too many epochs per batch.", "A reward hack found and exploited.",
                    "No entropy regularisation with a sharp reward."],
            look=["rlwatch_mismatch_kl_k3 and the drift scores; the reward per environment."],
            do=["Lower the learning rate, add an entropy bonus or KL penalty, or stop and resume earlier."]),
        example=Example(series={f"rlwatch_entropy_mean{{{_R}}}": _const(1.0, 5) + _const(0.1, 5),
                                f"rlwatch_step{{{_R}}}": _steps(10)},
                        fires_at=7, labels={"run": "r1"}, value=0.1),
    ),
    Alert(
        name="RLWatchNonFiniteLogProbs", severity="warning", for_minutes=4,
        expr=(f"run:rlwatch_nonfinite_tokens:ratio_rate10m > on(run) group_left() "
              f"{threshold('nonfinite_ratio_max')}"),
        params=("nonfinite_ratio_max",),
        summary="Log-probs are NaN or infinite.",
        description=("Run {{ $labels.run }}: {{ $value | humanizePercentage }} of response tokens have a "
                     "non-finite log-prob (excluded from the mismatch signals)."),
        windows="Prometheus: rate ratio over [10m], for 4m. Embedded: the last 10 steps, for 5 steps.",
        condition=_counter_ratio("nonfinite_tokens_total", "tokens_total", 10, "nonfinite_ratio_max",
                                 lambda k: k, ()),
        runbook=Runbook(
            meaning="A -inf sampler log-prob means the sampler reported a token its own truncated distribution "
                    "excluded (top-p/top-k); NaN means a numeric fault in a kernel.",
            causes=["Top-p/top-k truncation in the reported log-probs.", "fp16 overflow, a bad kernel."],
            look=["rlwatch_sampler_top_p/top_k, rlwatch_mismatch_log_ratio_mean."],
            do=["Report untruncated log-probs from the sampler; check precision settings."]),
        example=Example(series={f"rlwatch_nonfinite_tokens_total{{{_R}}}": _cumulative(_const(0.0, 10) +
                                                                                    _const(5.0, 20)),
                                f"rlwatch_tokens_total{{{_R}}}": _cumulative(_const(1000.0, 30)),
                                f"rlwatch_step{{{_R}}}": _steps(30)},
                        fires_at=16, labels={"run": "r1"}, value=0.0035),
    ),
    Alert(
        name="RLWatchTrainerStalled", severity="critical", for_minutes=0,
        expr=f"time() - rlwatch_last_step_timestamp_seconds > on(run) group_left() {threshold('stall_seconds')}",
        params=("stall_seconds",),
        summary="The trainer has not finished a step for too long.",
        description="Run {{ $labels.run }}: no step for {{ $value | humanizeDuration }}.",
        windows="Prometheus: wall time since the last observed step. Embedded: a watchdog thread in the "
                "training process compares the same timestamp with the clock every few seconds.",
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
        name="RLWatchExporterDown", severity="critical", for_minutes=1,
        expr='up{job=~"rlwatch.*"} == 0',
        labels=("job", "instance"),
        summary="Prometheus cannot scrape an rlwatch exporter.",
        description="{{ $labels.instance }} (job {{ $labels.job }}) is down; its run's alerts are inhibited.",
        windows="Prometheus only: the embedded evaluator lives in the process that exports.",
        embedded_note="Prometheus only",
        runbook=Runbook(
            meaning="The training process died, hung hard, or its metrics endpoint is unreachable. Every "
                    "alert that depends on this exporter is silenced by the Alertmanager inhibition.",
            causes=["The job crashed or was preempted.", "The port moved (port_fallback) or a firewall."],
            look=["The job scheduler; `rlwatch postmortem` on the run store for the last steps it recorded."],
            do=["Restart from the last healthy checkpoint; fix the scrape target."]),
        example=Example(series={'up{job="rlwatch",instance="127.0.0.1:9400"}': [1.0, 1.0, 0.0, 0.0, 0.0]},
                        fires_at=3, labels={"job": "rlwatch", "instance": "127.0.0.1:9400"}, value=0.0),
    ),
    Alert(
        name="RLWatchHookErrors", severity="warning", for_minutes=9,
        expr="sum by (run, stage, kind) (rate(rlwatch_hook_errors_total[10m])) > 0",
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
        expr="vector(1)",
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


def evaluate(alert: Alert, history: History) -> Firing:
    """The embedded reading of ``alert`` on ``history`` (empty when it is Prometheus-only)."""
    if alert.condition is None:
        return []
    return [(labels, value) for labels, value in alert.condition(history)
            if value is not None and not (isinstance(value, float) and math.isnan(value))]


def stalled(history: History, now: float) -> Firing:
    """The watchdog's reading of RLWatchTrainerStalled at wall time ``now``."""
    return _seconds_since_step(history, now)


def defaults() -> dict[str, float]:
    return {name: p.default for name, p in PARAMS.items()}


__all__ = ["ALERTS", "BY_NAME", "PARAMS", "RECORDING_RULES", "Alert", "Example", "History", "Runbook",
           "defaults", "evaluate", "stalled", "threshold"]
