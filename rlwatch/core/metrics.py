"""The catalogue of every metric rlwatch exports.

One place names each signal. Exporters (Prometheus, OpenTelemetry), the run store, the alert
rules and the dashboards all read their names from here, so a name cannot drift between them.
The entry of a declared signal (``rlwatch.signals.quantities``: the lag, mismatch, importance-sampling,
group, reward, length and environment families) lives with its declaration (``Metric(help=...,
section=...)``) and is made here by :func:`declared_specs`; the others (the step, the hook, the
alerts, the rollout system, ...) are written below. Every family carries a ``run`` label in addition
to the labels listed here.

Kinds:
- ``gauge``: the value at the latest step (a per-step summary such as a p99 or k3).
- ``counter``: a running total across steps; per step, the signals produce the increment.
- ``histogram``: classic Prometheus buckets, filled from vectorised counts.
- ``info``: a constant 1 with descriptive labels.
- ``sample``: per-episode values kept in the run store only (never exported): the last label numbers
  the episode.
"""

from __future__ import annotations

from dataclasses import dataclass

# The catalogue's label values are defined beside the signals that split by them.
from ..signals import quantities
from ..signals.buckets import (DROP_REASONS, DURATION_BUCKET_LABELS, DURATION_BUCKETS,  # noqa: F401
                               DURATION_LE_LABELS, DURATION_SAMPLE_MAX, LAG_BUCKET_LABELS, LAG_BUCKETS, LAG_LE_LABELS,
                               PROB_BIN_EDGES, PROB_BIN_LABELS, ZERO_VARIANCE_KINDS, bucket_labels)

PREFIX = "rlwatch_"


#: The phases a step's wall time splits into (``phase_seconds{phase}``); other names are kept as given.
PHASES: tuple[str, ...] = ("generation", "training", "sync")


#: Exported names that differ from the in-process key (store column, StepValues, OpenTelemetry callback):
#: per-step gauges whose family name clashed with a counter's (``rlwatch_tokens`` beside
#: ``rlwatch_tokens_total``: the same family in OpenMetrics, which strict parsers reject). Key -> exported
#: name without the prefix; the README's "Renamed metrics" table lists the same old -> new names.
RENAMED: dict[str, str] = {
    "tokens": "step_tokens",
    "sequences": "step_sequences",
    "groups": "step_groups",
    "mismatch_tokens": "step_mismatch_tokens",
    "nonfinite_rewards": "step_nonfinite_rewards",
    "nonfinite_tokens": "step_nonfinite_tokens",
    "hook_compute_seconds": "step_hook_compute_seconds",
    "phase_seconds": "step_phase_seconds",
    "weight_sync_seconds": "step_weight_sync_seconds",
}


@dataclass(frozen=True)
class MetricSpec:
    """One metric family. ``name`` is the in-process key, without the ``rlwatch_`` prefix; the
    exported family is :attr:`full_name`."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    group: str = "step"
    unit: str = ""

    @property
    def full_name(self) -> str:
        return PREFIX + RENAMED.get(self.name, self.name)

    @property
    def level(self) -> str:
        """What one value summarises: the step's ``token``, ``sequence`` or ``episode`` quantities, or
        ``step`` (the hook, the configuration, what the record or the framework states)."""
        return _LEVELS.get(self.name) or _GROUP_LEVELS.get(self.group, "step")


def _g(name: str, help: str, group: str, labels: tuple[str, ...] = (), unit: str = "") -> MetricSpec:
    return MetricSpec(name, "gauge", help, labels, group, unit)


def _c(name: str, help: str, group: str, labels: tuple[str, ...] = (), unit: str = "") -> MetricSpec:
    assert name.endswith("_total"), name
    return MetricSpec(name, "counter", help, labels, group, unit)


def threshold_specs() -> tuple[MetricSpec, ...]:
    """The config gauge of each declared signal threshold (a band: one per value), its help from the declaration."""
    return tuple(_g(name, help, "config") for t in quantities.SIGNAL_THRESHOLDS
                 for name, _, help in t.gauges(t.value))


def declared_specs() -> tuple[MetricSpec, ...]:
    """The catalogue entries of the declared metrics (``rlwatch.signals.quantities``), from their ``help`` and
    ``section``: a histogram when declared so, a counter when the name ends in ``_total``, else a gauge,
    labelled as their ``by`` splits them (a histogram by its buckets); internal values have none."""
    out = []
    for m in quantities.METRICS + quantities.EPISODE_METRICS:
        if m.kind == "histogram":
            out.append(MetricSpec(m.name, "histogram", m.help, (), m.section))
        elif m.exported:
            out.append((_c if m.name.endswith("_total") else _g)(m.name, m.help, m.section,
                                                                 quantities.BY_LABEL_NAMES[m.by]))
    return tuple(out)


CATALOGUE: tuple[MetricSpec, ...] = (
    # --- step and hook ---------------------------------------------------------------------
    _g("step", "Training step of the latest observed batch.", "step"),
    _g("trainer_version", "Policy version held by the trainer at the latest step (updates).", "step"),
    _g("sequences", "Sequences (episodes) in the latest step.", "step"),
    _g("entropy_mean", "Mean per-token policy entropy over response tokens (nats).", "step"),
    _g("env_entropy_mean", "Mean per-token policy entropy over response tokens per environment in the latest step "
       "(nats).", "env", ("env",)),
    _g("step_interval_seconds", "Wall time between the two latest observed steps.", "step", unit="seconds"),
    _g("last_step_timestamp_seconds", "Unix time at which the latest step was observed.", "step", unit="seconds"),
    _g("hook_compute_seconds", "rlwatch's own compute time for the latest step (signals and host sync).",
       "hook", unit="seconds"),
    _c("steps_total", "Steps observed.", "step"),
    _c("sequences_total", "Sequences (episodes) observed.", "step"),
    _c("hook_compute_seconds_total", "rlwatch's own compute time, summed over steps.", "hook", unit="seconds"),
    _c("signal_unavailable_total", "Steps on which a signal family could not be computed from what the "
       "framework provides (e.g. no sampler log-probs), by family and reason.", "hook", ("signal", "reason")),
    _c("hook_errors_total", "Errors rlwatch caught in its own code or in the observed record, by stage and kind.",
       "hook", ("stage", "kind")),
    _c("http_client_errors_total", "Requests the /metrics server answered with a client error (malformed "
       "request, missing credentials, unknown path, request head too slow or too large), by HTTP status code; "
       "never counted as rlwatch's own error.", "hook", ("code",)),
    _g("store_queue_depth", "Steps waiting to be written to the run store.", "hook"),
    _c("store_dropped_steps_total", "Steps the run store could not write (queue full or write error).", "hook"),
    _c("store_step_conflicts_total", "Steps observed again (resumed run, two processes on one run); the earlier "
       "row is kept in the store's step_history.", "hook"),
    *threshold_specs(),     # the signal thresholds' config gauges (rlwatch_is_cap, ...), from their declaration
    _g("alert_threshold", "Alert threshold in force for this run (catalogue default or the run's override), "
       "by parameter.", "config", ("param",)),
    _g("drift_score", "Baseline-relative drift score of a signal (one-sided CUSUM of robust z-scores; 0 = "
       "no drift), by signal and, for per-environment signals, environment and detector.", "drift",
       ("signal", "env", "detector")),
    _g("alert_value", "An alert's step-window statistic at the latest step (the value its rule shows), by "
       "alert and the alert's own labels (unused ones empty).", "alerts",
       ("alert", "signal", "env", "detector", "kind")),
    _g("alert_streak_steps", "Consecutive steps an alert's raise condition has held (absent when 0).", "alerts",
       ("alert", "signal", "env", "detector", "kind")),
    _g("alert_hit_steps", "For an intermittent alert, steps among the last intermittent_steps on which its raise "
       "condition held (absent when 0); intermittent_hits of them open it.", "alerts",
       ("alert", "signal", "env", "detector", "kind")),
    _g("alert_quiet_steps", "For an open alert, steps since its hold condition last held (0 while it holds); "
       "the alert fires while this is below the clear_steps threshold.", "alerts",
       ("alert", "signal", "env", "detector", "kind")),
    _g("alert_incident", "One series per time an alert opened (incident: its ordinal per alert and label set): "
       "state=open with the statistic while open, then state=resolved with the value it opened with, kept 10 "
       "minutes; the rules page on these, so an incident reaches Prometheus whatever the scrape interval.",
       "alerts", ("alert", "signal", "env", "detector", "kind", "incident", "state")),
    _g("window_baseline", "Trailing baseline a step-window alert compared a signal with (k3: mean of the 30 "
       "steps ending 5 steps ago; entropy: maximum of the previous 120 steps).", "alerts", ("signal",)),
    _g("window_stderr", "Standard error or step-to-step standard deviation a step-window alert used for a "
       "signal (mean log-ratio: per-step standard error from k2 and the token count; k3: the baseline's "
       "standard deviation).", "alerts", ("signal",)),
    _g("window_run_baseline", "The run's own baseline of a signal (k3: its lowest 20-step median so far; it never "
       "follows a climb), which RLWatchKLDeparture compares with.", "alerts", ("signal",)),
    _g("window_baseline_ratio", "A signal's 5-step median over its run baseline (k3: RLWatchKLDeparture pages at "
       "kl_departure_factor).", "alerts", ("signal",)),
    _g("window_forecast_steps", "Steps until a signal reaches its critical bound at its log-linear trend over the "
       "last 40 steps (k3: kl_k3_max); absent without a significant upward trend.", "alerts", ("signal",)),
    MetricSpec("diagnosis_info", "info", "Most likely cause of the sampler-learner mismatch at the latest "
               "diagnosis, with its confidence label.", ("cause", "confidence"), "diagnosis"),
    _g("sampler_temperature", "Sampling temperature the sampler reported.", "sampler"),
    _g("sampler_top_p", "Top-p the sampler reported.", "sampler"),
    _g("sampler_top_k", "Top-k the sampler reported (-1 or 0 when disabled).", "sampler"),
    MetricSpec("sampler_info", "info", "Sampler settings as labels (log-prob mode).", ("logprobs_mode",), "sampler"),
    MetricSpec("run_info", "info", "Run metadata.", ("framework", "framework_version", "rlwatch_version"), "step"),
    _g("framework_metric", "A scalar the training framework logged itself (grad norm, loss, ...), by name.",
       "framework", ("name",)),
    # --- the trainer's dynamics (what it logs: rlwatch.core.trainer_keys) ----------------------
    _g("policy_kl", "KL between consecutive policies over the update's tokens (nats): k3 of observe's updated_logp "
       "against trainer_logp, else what the trainer logs as ppo_kl or approx_kl.", "dynamics"),
    _g("ref_kl", "KL between the policy and the reference policy the trainer logs (its KL penalty term; nats).",
       "dynamics"),
    _g("grad_norm", "Gradient norm the trainer logged at the latest step (before clipping; finite values only).",
       "dynamics"),
    _g("grad_norm_nonfinite", "1 when the trainer's latest logged gradient norm was NaN or infinite, else 0.",
       "dynamics"),
    _g("grad_norm_zero", "1 when the trainer's latest logged gradient norm was exactly 0 (no learning signal), "
       "else 0.", "dynamics"),
    _g("loss", "Policy loss the trainer logged at the latest step (finite values only).", "dynamics"),
    _g("loss_nonfinite", "1 when the trainer's latest logged loss was NaN or infinite, else 0.", "dynamics"),
    _g("clip_fraction", "Fraction of tokens the PPO ratio clip cut at the latest step (the trainer's "
       "pg_clipfrac / clip_ratio).", "dynamics"),
    _g("zero_std_ratio", "Share of the trained batch in groups whose rewards were all equal (zero advantage), as "
       "the trainer logged it (TRL: frac_reward_zero_std); at 1 the step had no learning signal, and the collapse "
       "precursors leave its entropy, gradient norm, policy KL and length out of their series.", "dynamics"),
    _g("learning_rate", "Learning rate the trainer logged at the latest step (RLWatchKLDeparture reads a warm-up "
       "from it).", "dynamics"),
    _g("heldout_score", "Held-out (validation) score the trainer logged, mean over its data sources.", "dynamics"),
    # --- generation batches (the groups, rewards, truncation and lengths: declared, below) --------
    _g("generation", "Serial number (1-based) of the latest generation batch whose episode-level series "
       "(groups, rewards, truncation, lengths, environments) are shown, where an integration computes them once "
       "per generation batch (TRL); repeated until the next batch is scored.", "groups"),
    _g("generation_policy_version", "Policy version (optimizer updates) that generated the batch named by "
       "rlwatch_generation.", "groups"),
    # --- per environment ---------------------------------------------------------------------
    _g("env_hack_ratio", "Fraction of episodes a reward-hack detector flagged, per environment and detector.",
       "env", ("env", "detector")),
    _g("env_failure_ratio", "Fraction of episodes that failed for an infrastructure reason, per kind.", "env",
       ("env", "kind")),
    _c("episodes_failed_total", "Episodes with an infrastructure failure, per environment and kind.", "env",
       ("env", "kind")),
    # --- rollout system: durations, phases, launched vs trained (docs/rollout-system.md) ------
    MetricSpec("episode_duration_seconds", "histogram", "Wall time of each trained episode, launch to finish, "
               "per environment.", ("env",), "rollout", "seconds"),
    _g("episode_duration_mean_seconds", "Mean duration of the step's trained episodes.", "rollout", unit="seconds"),
    _g("episode_duration_p50_seconds", "Median duration of the step's trained episodes.", "rollout",
       unit="seconds"),
    _g("episode_duration_p95_seconds", "95th percentile of the step's trained episode durations.", "rollout",
       unit="seconds"),
    _g("episode_duration_max_seconds", "Longest trained episode of the step.", "rollout", unit="seconds"),
    _g("episode_duration_max_over_mean", "Longest over mean trained episode duration (the straggler factor).",
       "rollout"),
    _g("straggler_wait_seconds", "Slowest minus median trained episode of the step: what a synchronous step "
       "waited for its straggler.", "rollout", unit="seconds"),
    _g("env_episode_duration_mean_seconds", "Mean trained episode duration per environment.", "rollout",
       ("env",), "seconds"),
    _g("env_episode_duration_p50_seconds", "Median trained episode duration per environment.", "rollout",
       ("env",), "seconds"),
    _g("env_episode_duration_p95_seconds", "95th percentile of trained episode durations per environment.",
       "rollout", ("env",), "seconds"),
    _g("env_episode_duration_max_seconds", "Longest trained episode per environment.", "rollout", ("env",),
       "seconds"),
    _g("env_episode_duration_max_over_mean", "Longest over mean trained episode duration per environment.",
       "rollout", ("env",)),
    MetricSpec("episode_duration_sample_seconds", "sample", "Per-episode durations of the step (up to "
               "DURATION_SAMPLE_MAX per outcome, evenly spaced), stored for rlwatch whatif; not exported.",
               ("outcome", "env", "index"), "rollout", "seconds"),
    _g("phase_seconds", "Seconds the step spent in each phase (generation, training, sync, ...).", "rollout",
       ("phase",), "seconds"),
    _c("phase_seconds_total", "Seconds spent in each phase, summed over steps.", "rollout", ("phase",), "seconds"),
    _g("weight_sync_seconds", "The step's weight-synchronisation pause (phase sync).", "rollout", unit="seconds"),
    _c("weight_sync_seconds_total", "Weight-synchronisation seconds, summed over steps.", "rollout",
       unit="seconds"),
    _c("episodes_launched_total", "Episodes launched per environment: trained plus dropped.", "rollout", ("env",)),
    _c("episodes_trained_total", "Episodes trained per environment (the observed batches).", "rollout", ("env",)),
    _c("episodes_dropped_total", "Launched episodes not trained, per environment and reason (filtered, timeout, "
       "failure, stale, other).", "rollout", ("env", "reason")),
    _g("launched_episode_duration_mean_seconds", "Mean duration of the step's launched episodes (trained and "
       "dropped).", "rollout", unit="seconds"),
    _g("trained_episode_duration_mean_seconds", "Mean duration of the step's trained episodes, beside the "
       "launched mean.", "rollout", unit="seconds"),
    _g("launched_response_length_mean", "Mean response length of the step's launched episodes (tokens).",
       "rollout"),
    _g("trained_response_length_mean", "Mean response length of the step's trained episodes (tokens).", "rollout"),
    _g("length_bias_duration_ratio", "Trained over launched mean episode duration: below 1, dropping episodes "
       "shortened the trained data.", "rollout"),
    _g("length_bias_length_ratio", "Trained over launched mean response length.", "rollout"),
    # --- the declared signals (rlwatch/signals/quantities/: lag, mismatch, importance sampling, groups,
    # rewards, lengths, environments): each entry is made from its declaration's help and section ---------
    *declared_specs(),
)

#: The level of each section's families (:attr:`MetricSpec.level`), and of those that differ from their section's.
_GROUP_LEVELS = {"lag": "token", "mismatch": "token", "is": "token", "groups": "episode", "length": "episode",
                 "env": "episode", "rollout": "episode"}
#: Each histogram's bucket labels: (the in-process and stored upper bounds, the exported ``le``).
HISTOGRAM_BUCKETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "token_version_lag": (LAG_BUCKET_LABELS, LAG_LE_LABELS),
    "episode_duration_seconds": (DURATION_BUCKET_LABELS, DURATION_LE_LABELS),
}
_LEVELS = {
    **dict.fromkeys(("phase_seconds", "phase_seconds_total", "weight_sync_seconds", "weight_sync_seconds_total"),
                    "step"),
    **dict.fromkeys(("tokens", "tokens_total", "entropy_mean", "env_entropy_mean"), "token"),
    **dict.fromkeys(("reward_mean", "reward_std", "nonfinite_rewards", "nonfinite_rewards_total"), "episode"),
    **dict.fromkeys(("mismatch_seq_log_ratio_abs_mean", "mismatch_seq_log_ratio_abs_max", "mismatch_chi2_sequence",
                     "is_seq_tis_high_ratio", "is_seq_tis_low_ratio", "is_seq_mis_masked_ratio",
                     "version_lag_sequence_max_mean", "partial_rollout_ratio", "partial_rollout_sequences_total"),
                    "sequence"),
}

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}


def exported_names() -> set[str]:
    """Every series name the Prometheus exposition can contain (histogram suffixes included)."""
    names: set[str] = set()
    for s in CATALOGUE:
        if s.kind == "histogram":
            names.update(s.full_name + suffix for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(s.full_name)
    return names
