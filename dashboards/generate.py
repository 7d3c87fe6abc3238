"""Build the rlwatch Grafana dashboards as plain dicts and write dashboards/*.json.

    python dashboards/generate.py           # write
    python dashboards/generate.py --check   # exit 1 when the checked-in JSON differs (CI)

A build-time tool: panel descriptions come from the help texts of rlwatch.core.metrics, thresholds are
drawn from the rlwatch_alert_threshold series each run exports, and the tests check every name
against a live exposition, so panels cannot drift from what rlwatch exports.
Every query is scoped by the ``run`` variable (and ``env`` where per environment) and reads the
``datasource`` variable. Targets Grafana 11 (schemaVersion 39).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlwatch.core.metrics import BY_NAME as METRICS  # noqa: E402

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
# A run name may be shared by several processes: every query also picks the process (run_instance).
RUN = 'run=~"$run", run_instance=~"$run_instance"'
ENV = f'{RUN}, env=~"$env"'
from rlwatch.alerts.render import DEFAULT_RUNBOOK_URL as RUNBOOK  # noqa: E402 - served by every exporter


class Layout:
    """Places panels left to right on Grafana's 24-column grid and hands out unique ids."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = self.row_height = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str, repeat: str | None = None) -> None:
        if self.x:
            self.y += self.row_height
        panel = {"type": "row", "id": self._id(), "title": title, "collapsed": False, "panels": [],
                 "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}}
        if repeat:
            panel["repeat"] = repeat
        self.panels.append(panel)
        self.y += 1
        self.x = self.row_height = 0

    def add(self, panel: dict, w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False, fmt: str | None = None) -> dict:
    legend = legend.replace("{{run}}", "{{run}} {{run_instance}}", 1)     # two processes of one run apart
    t = {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend or "__auto",
         "range": not instant, "instant": instant}
    if fmt:
        t["format"] = fmt
    return t


def describe(metric: str | None, bad: str, alert: str | None = None) -> str:
    text = METRICS[metric].help + " " if metric else ""
    text += f"Bad: {bad}"
    if alert:
        text += f" Alert: {alert} ({RUNBOOK}#{alert.lower()})."
    return text


def threshold_target(param: str, ref: str) -> dict:
    return target(f'rlwatch_alert_threshold{{{RUN}, param="{param}"}}', f"{{{{run}}}} {param}", ref)


def threshold_panel(title: str, expr: str, legend: str, param: str, metric: str, bad: str, alert: str,
                    **options) -> dict:
    """A time series of one signal next to the run's alert threshold ``param`` (dashed red), described
    by the catalogue's help for ``metric``; ``options`` go to :func:`timeseries`."""
    return timeseries(title, [target(expr, legend), threshold_target(param, "B")], describe(metric, bad, alert),
                      **options)


def timeseries(title: str, targets: list[dict], description: str, unit: str = "short",
               thresholds_dashed: bool = True, log: bool = False) -> dict:
    overrides = []
    if thresholds_dashed:
        overrides.append({"matcher": {"id": "byRegexp", "options": ".*(_max|_min|bound|ratio_max)$"},
                          "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                         {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]})
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0, "showPoints": "never", "spanNulls": True}
    if log:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    return {"type": "timeseries", "title": title, "description": description, "datasource": DS,
            "targets": [dict(t, refId=t["refId"]) for t in targets],
            "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": overrides},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, expr: str, description: str, unit: str = "short", mappings: list | None = None,
         steps: list | None = None, legend: str = "{{run}}") -> dict:
    return {"type": "stat", "title": title, "description": description, "datasource": DS,
            "targets": [target(expr, legend, instant=True)],
            "fieldConfig": {"defaults": {"unit": unit, "mappings": mappings or [],
                                         "thresholds": {"mode": "absolute", "steps": steps or [
                                             {"color": "green", "value": None}]}},
                            "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "graphMode": "none", "textMode": "value_and_name"}}


HEALTH_MAPPINGS = [{"type": "value", "options": {"0": {"text": "healthy", "color": "green", "index": 0},
                                                 "1": {"text": "warning", "color": "yellow", "index": 1},
                                                 "2": {"text": "critical", "color": "red", "index": 2}}}]
HEALTH_STEPS = [{"color": "green", "value": None}, {"color": "yellow", "value": 1}, {"color": "red", "value": 2}]
# 2 when a critical alert of the run fires, 1 for a warning, else 0 (the run's step series keeps it defined).
HEALTH_EXPR = (f'max by (run, run_instance) (2 * ALERTS{{alertstate="firing", severity="critical", {RUN}}}'
               f' or ALERTS{{alertstate="firing", severity="warning", {RUN}}}'
               f' or 0 * rlwatch_step{{{RUN}}})')


def variables() -> dict:
    def query_var(name: str, label: str, query: str) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": query, "refId": f"var-{name}"}, "definition": query, "refresh": 2,
                "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "sort": 1}
    return {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "current": {},
         "refresh": 1},
        query_var("run", "Run", "label_values(rlwatch_step, run)"),
        query_var("run_instance", "Process", 'label_values(rlwatch_step{run=~"$run"}, run_instance)'),
        query_var("env", "Environment", f"label_values(rlwatch_env_episodes{{{RUN}}}, env)"),
    ]}


def annotations() -> dict:
    return {"list": [
        {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
         "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
        {"datasource": DS, "enable": True, "iconColor": "red", "name": "rlwatch alerts",
         "expr": f'ALERTS{{alertstate="firing", {RUN}}}', "step": "30s", "titleFormat": "{{alertname}}",
         "textFormat": "{{run}} {{run_instance}} {{severity}}", "tagKeys": "severity,run,run_instance",
         "useValueForTime": False},
    ]}


def dashboard(uid: str, title: str, description: str, layout: Layout) -> dict:
    return {"uid": uid, "title": title, "description": description, "tags": ["rlwatch"], "timezone": "browser",
            "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1,
            "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "templating": variables(),
            "annotations": annotations(), "panels": layout.panels,
            "links": [{"title": "Runbook", "url": RUNBOOK, "type": "link", "targetBlank": True}]}


# --- overview -----------------------------------------------------------------------------------

def overview() -> dict:
    lay = Layout()
    lay.row("Run $run", repeat="run")
    lay.add(stat("Health", HEALTH_EXPR, "Worst firing rlwatch alert of the run: healthy, warning or critical. "
                 "The time axis of every panel carries the alerts as annotations.",
                 mappings=HEALTH_MAPPINGS, steps=HEALTH_STEPS), w=4, h=4)
    lay.add(stat("Step", f"rlwatch_step{{{RUN}}}", describe("step", "a step count that stops moving: the "
                 "trainer stalled.", "RLWatchTrainerStalled")), w=4, h=4)
    lay.add(stat("Policy version", f"rlwatch_trainer_version{{{RUN}}}",
                 describe("trainer_version", "versions that stop while steps go on: weights not synced.")), w=4, h=4)
    lay.add(stat("Steps per hour", f"rate(rlwatch_steps_total{{{RUN}}}[$__rate_interval]) * 3600",
                 "Training steps completed per hour. Bad: a drop to zero (stall) or a sudden change in pace."),
            w=4, h=4)
    lay.add(stat("Firing alerts", f'count by (run, run_instance) (ALERTS{{alertstate="firing", {RUN}}}) '
                 f"or 0 * rlwatch_step{{{RUN}}}", "Number of rlwatch alerts firing for the run.",
                 steps=HEALTH_STEPS[:2]), w=4, h=4)
    lay.add(stat("Max version lag", f"rlwatch_version_lag_max{{{RUN}}}",
                 describe("version_lag_max", "far above the staleness bound.", "RLWatchVersionLagFarAboveBound")),
            w=4, h=4)
    lay.row("Headline signals (thresholds dashed)")
    lay.add(threshold_panel("KL(mu || pi_old), k3", f"rlwatch_mismatch_kl_k3{{{RUN}}}", "{{run}} k3", "kl_k3_max",
                            "mismatch_kl_k3", "a spike above the bound or a steady climb; numeric bf16 mismatch "
                            "alone is ~1e-3.", "RLWatchKLSpike", log=True))
    k3_window = f'{{{RUN}, signal="mismatch_kl_k3"}}'
    lay.add(timeseries("k3 against the run's own baseline", [
        target(f"rlwatch_mismatch_kl_k3{{{RUN}}}", "{{run}} k3"),
        target(f"rlwatch_window_run_baseline{k3_window}", "{{run}} run baseline", "B"),
        target(f"rlwatch_window_run_baseline{k3_window} * on(run, run_instance) "
               f'rlwatch_alert_threshold{{{RUN}, param="kl_departure_factor"}}', "{{run}} departure bound", "C")],
        describe("window_run_baseline", "k3 leaving its baseline by kl_departure_factor (and above "
                 "kl_departure_floor): the climb that comes before a collapse.", "RLWatchKLDeparture"), log=True))
    lay.add(timeseries("Steps to kl_k3_max at this trend", [
        target(f"rlwatch_window_forecast_steps{k3_window}", "{{run}} steps left")],
        describe("window_forecast_steps", "a forecast that shrinks step after step: k3 is on its way to the "
                 "bound; no line: no upward trend.", "RLWatchKLDeparture")))
    lay.add(threshold_panel("Effective sample size", f"rlwatch_is_ess_ratio{{{RUN}}}", "{{run}} ESS", "ess_min",
                            "is_ess_ratio", "below 0.3: a few tokens carry the correction.", "RLWatchESSLow",
                            unit="percentunit"))
    lay.add(timeseries("Version lag", [target(f"rlwatch_version_lag_max{{{RUN}}}", "{{run}} max"),
                                        target(f"rlwatch_version_lag_mean{{{RUN}}}", "{{run}} mean", "B"),
                                        target(f"rlwatch_staleness_bound{{{RUN}}}", "{{run}} staleness bound", "C")],
                       describe("version_lag_max", "above the staleness bound; growing without bound means the "
                                "weight sync is broken.", "RLWatchStalenessBoundExceeded")))
    lay.add(timeseries("TIS truncated fraction", [
        target(f"run:rlwatch_is_tis_truncated_tokens:ratio_rate10m{{{RUN}}}", "{{run}} w > C (10m)"),
        target(f"rlwatch_mismatch_abs_log_ratio_mean{{{RUN}}}", "{{run}} mean |log ratio|", "B"),
        threshold_target("tis_truncated_max", "C")],
        describe("is_tis_high_ratio", "many weights at the cap; read next to the raw mismatch.",
                 "RLWatchISTruncationHigh"), unit="percentunit"))
    lay.add(threshold_panel("Zero-variance groups", f"rlwatch_zero_variance_groups_ratio{{{RUN}}}", "{{run}} {{kind}}",
                            "zero_variance_max", "zero_variance_groups_ratio",
                            "most groups all pass or all fail: no gradient.", "RLWatchZeroVarianceGroupsHigh",
                            unit="percentunit"))
    lay.add(threshold_panel("Reward-hack rate by environment",
                            f"run_env_detector:rlwatch_episodes_hacked:ratio_rate10m{{{ENV}}}",
                            "{{run}} {{env}} {{detector}}", "hack_ratio_max", "env_hack_ratio",
                            "a rising rate in one environment.", "RLWatchRewardHackRateRising", unit="percentunit"))
    lay.add(timeseries("Entropy", [target(f"rlwatch_entropy_mean{{{RUN}}}", "{{run}}")],
                       describe("entropy_mean", "a collapse toward 0.", "RLWatchEntropyCollapse")))
    lay.add(timeseries("Reward", [target(f"rlwatch_reward_mean{{{RUN}}}", "{{run}} mean"),
                                  target(f"rlwatch_env_reward_mean{{{ENV}}}", "{{run}} {{env}}", "B")],
                       describe("reward_mean", "a reward that rises while hack or mismatch signals rise too.")))
    lay.add(threshold_panel("Drift scores", f"rlwatch_drift_score{{{RUN}}}", "{{run}} {{signal}} {{env}}",
                            "drift_score_max", "drift_score", "a score climbing past the bound: the signal left "
                            "its own baseline.", "RLWatchMismatchDrift"))
    return dashboard("rlwatch-overview", "rlwatch / overview",
                     "Is each run healthy, and if not, which signal moved first.", lay)


# --- details --------------------------------------------------------------------------------------

def details() -> dict:
    lay = Layout()
    lay.row("Off-policy: staleness")
    lay.add({"type": "heatmap", "title": "Version lag heatmap (tokens per step)",
             "description": describe("token_version_lag", "mass moving to higher lags.",
                                     "RLWatchStalenessBoundExceeded"),
             "datasource": DS, "targets": [target(
                 f"sum by (le) (increase(rlwatch_token_version_lag_bucket{{{RUN}}}[$__rate_interval]))",
                 "{{le}}", fmt="heatmap")],
             "options": {"calculate": False, "yAxis": {"unit": "short"}, "cellGap": 1,
                         "color": {"mode": "scheme", "scheme": "Oranges"}},
             "fieldConfig": {"defaults": {}, "overrides": []}}, w=12)
    lay.add(timeseries("Lag mean / p99 / max vs bound", [
        target(f"rlwatch_version_lag_mean{{{RUN}}}", "{{run}} mean"),
        target(f"rlwatch_version_lag_p99{{{RUN}}}", "{{run}} p99", "B"),
        target(f"rlwatch_version_lag_max{{{RUN}}}", "{{run}} max", "C"),
        target(f"rlwatch_staleness_bound{{{RUN}}}", "{{run}} staleness bound", "D")],
        describe("version_lag_p99", "p99 or max above the bound.", "RLWatchVersionLagFarAboveBound")), w=12)
    lay.add(timeseries("Partial rollouts and over-bound tokens", [
        target(f"rlwatch_partial_rollout_ratio{{{RUN}}}", "{{run}} partial rollouts"),
        target(f"run:rlwatch_tokens_over_staleness_bound:ratio_rate10m{{{RUN}}}", "{{run}} over bound (10m)", "B")],
        describe("partial_rollout_ratio", "many sequences mixing versions while the mismatch rises."),
        unit="percentunit"), w=12)
    lay.add(timeseries("Per-sequence max lag (mean)", [
        target(f"rlwatch_version_lag_sequence_max_mean{{{RUN}}}", "{{run}}")],
        describe("version_lag_sequence_max_mean", "growing with the trainer version: sync broken.")), w=12)

    lay.row("Sampler-learner mismatch")
    lay.add(timeseries("KL estimators k1 / k2 / k3", [
        target(f"rlwatch_mismatch_kl_k1{{{RUN}}}", "{{run}} k1"),
        target(f"rlwatch_mismatch_kl_k2{{{RUN}}}", "{{run}} k2", "B"),
        target(f"rlwatch_mismatch_kl_k3{{{RUN}}}", "{{run}} k3", "C"),
        threshold_target("kl_k3_max", "D")],
        describe("mismatch_kl_k3", "k3 above the bound; k1 far from k3 means a few large ratios.",
                 "RLWatchKLSpike")))
    lay.add(timeseries("Chi-square (token, sequence)", [
        target(f"rlwatch_mismatch_chi2_token{{{RUN}}}", "{{run}} token"),
        target(f"rlwatch_mismatch_chi2_sequence{{{RUN}}}", "{{run}} sequence", "B")],
        describe("mismatch_chi2_token", "token chi2 above 1 (verl's bound): IS variance explodes."), log=True))
    lay.add(timeseries("|Δ log p| p50 / p99 / max", [
        target(f"rlwatch_mismatch_abs_log_ratio_p50{{{RUN}}}", "{{run}} p50"),
        target(f"rlwatch_mismatch_abs_log_ratio_p99{{{RUN}}}", "{{run}} p99", "B"),
        target(f"rlwatch_mismatch_abs_log_ratio_max{{{RUN}}}", "{{run}} max", "C")],
        describe("mismatch_abs_log_ratio_p99", "p99 rising step after step (drift).", "RLWatchMismatchDrift"),
        log=True))
    lay.add(timeseries("Mean |Δ log p| by sampler probability", [
        target(f"rlwatch_mismatch_abs_log_ratio_by_prob{{{RUN}}}", "{{run}} p in {{prob_bin}}")],
        describe("mismatch_abs_log_ratio_by_prob", "mismatch on high-probability tokens (numeric noise sits on "
                 "low-probability ones).")))
    lay.add(timeseries("Mismatch by version lag (k3, mean |Δ log p|)", [
        target(f"rlwatch_mismatch_kl_k3_by_lag{{{RUN}}}", "{{run}} k3, lag ≤ {{lag}}"),
        target(f"rlwatch_mismatch_abs_log_ratio_mean_by_lag{{{RUN}}}", "{{run}} |r|, lag ≤ {{lag}}", "B")],
        describe("mismatch_kl_k3_by_lag", "mismatch growing with lag (staleness); a high lag-0 level is numerics "
                 "or semantics."), log=True))
    lay.add(timeseries("Sequence log-ratio |Σ r|", [
        target(f"rlwatch_mismatch_seq_log_ratio_abs_mean{{{RUN}}}", "{{run}} mean"),
        target(f"rlwatch_mismatch_seq_log_ratio_abs_max{{{RUN}}}", "{{run}} max", "B")],
        describe("mismatch_seq_log_ratio_abs_mean", "sequence ratios spread over orders of magnitude.")))
    lay.add(timeseries("Signed log-ratio and non-finite tokens", [
        target(f"rlwatch_mismatch_log_ratio_mean{{{RUN}}}", "{{run}} mean r"),
        target(f"run:rlwatch_nonfinite_tokens:ratio_rate10m{{{RUN}}}", "{{run}} non-finite fraction (10m)", "B")],
        describe("mismatch_log_ratio_mean", "a constant offset from step 0 (semantics) or non-finite log-probs.",
                 "RLWatchOnPolicyRatioNotOne")))

    lay.row("Importance sampling (always next to the raw mismatch)")
    lay.add(timeseries("TIS: w > C and w < 1/C", [
        target(f"rlwatch_is_tis_high_ratio{{{RUN}}}", "{{run}} w > C"),
        target(f"rlwatch_is_tis_low_ratio{{{RUN}}}", "{{run}} w < 1/C", "B"),
        target(f"rlwatch_mismatch_abs_log_ratio_mean{{{RUN}}}", "{{run}} mean |log ratio|", "C")],
        describe("is_tis_high_ratio", "many capped weights; a masked or capped fraction alone misleads.",
                 "RLWatchISTruncationHigh"), unit="percentunit"))
    lay.add(timeseries("MIS masked fraction", [
        target(f"rlwatch_is_mis_masked_ratio{{{RUN}}}", "{{run}} token"),
        target(f"rlwatch_is_seq_mis_masked_ratio{{{RUN}}}", "{{run}} sequence", "B"),
        target(f"rlwatch_mismatch_kl_k3{{{RUN}}}", "{{run}} k3", "C")],
        describe("is_mis_masked_ratio", "masking removes exactly the tokens that carry the correction."),
        unit="percentunit"))
    lay.add(timeseries("Effective sample size (truncated and raw)", [
        target(f"rlwatch_is_ess_ratio{{{RUN}}}", "{{run}} truncated"),
        target(f"rlwatch_is_ess_raw_ratio{{{RUN}}}", "{{run}} raw", "B"),
        threshold_target("ess_min", "C")],
        describe("is_ess_ratio", "below 0.3.", "RLWatchESSLow"), unit="percentunit"))
    lay.add(timeseries("Sequence-level TIS fractions", [
        target(f"rlwatch_is_seq_tis_high_ratio{{{RUN}}}", "{{run}} > C"),
        target(f"rlwatch_is_seq_tis_low_ratio{{{RUN}}}", "{{run}} < 1/C", "B")],
        describe("is_seq_tis_high_ratio", "long sequences spread the product of ratios widely."),
        unit="percentunit"), w=24)

    lay.row("Data: groups, truncation, lengths")
    lay.add(timeseries("Zero-variance groups by kind", [
        target(f"rlwatch_zero_variance_groups_ratio{{{RUN}}}", "{{run}} {{kind}}"),
        target(f"rlwatch_zero_gradient_episodes_ratio{{{RUN}}}", "{{run}} episodes without gradient", "B")],
        describe("zero_variance_groups_ratio", "all_pass (too easy or hacked) or all_fail (too hard or broken "
                 "grader).", "RLWatchZeroVarianceGroupsHigh"), unit="percentunit"))
    lay.add(threshold_panel("Truncation rate", f"rlwatch_truncated_ratio{{{RUN}}}", "{{run}}", "truncated_max",
                            "truncated_ratio", "responses hitting the limit.", "RLWatchTruncationRateHigh",
                            unit="percentunit"))
    lay.add(timeseries("Response length", [
        target(f"rlwatch_response_length_mean{{{RUN}}}", "{{run}} mean"),
        target(f"rlwatch_response_length_p99{{{RUN}}}", "{{run}} p99", "B"),
        target(f"rlwatch_response_length_max{{{RUN}}}", "{{run}} max", "C")],
        describe("response_length_mean", "length growing with reward (a length hack) or hitting the limit.")))

    lay.row("Environments")
    lay.add(timeseries("Reward by environment", [target(f"rlwatch_env_reward_mean{{{ENV}}}", "{{run}} {{env}}")],
                       describe("env_reward_mean", "reward rising in one environment while its hack rate rises.")))
    lay.add(threshold_panel("Hack rate by environment and detector", f"rlwatch_env_hack_ratio{{{ENV}}}",
                            "{{run}} {{env}} {{detector}}", "hack_ratio_max", "env_hack_ratio",
                            "rising in one environment.", "RLWatchRewardHackRateRising", unit="percentunit"))
    lay.add(threshold_panel("Infrastructure failures by kind",
                            f"run_env_kind:rlwatch_episodes_failed:ratio_rate10m{{{ENV}}}", "{{run}} {{env}} {{kind}}",
                            "failure_ratio_max", "env_failure_ratio",
                            "failures scored as reward teach the policy to avoid crashes.",
                            "RLWatchInfraFailureRateHigh", unit="percentunit"))
    lay.add(timeseries("Truncation by environment", [
        target(f"run_env:rlwatch_episodes_truncated:ratio_rate10m{{{ENV}}}", "{{run}} {{env}}")],
        describe("env_truncated_ratio", "one environment's episodes hitting the limit."), unit="percentunit"))
    worst = (f"sort_desc(max by (run, env) (rlwatch_env_hack_ratio{{{ENV}}})"
             f" or max by (run, env) (0 * rlwatch_env_episodes{{{ENV}}}))")
    lay.add({"type": "table", "title": "Environments, worst first (hack rate, failures, truncation, reward)",
             "description": "Latest per-environment signals, sorted by the highest hack rate of any detector. "
                            f"Runbook: {RUNBOOK}#rlwatchrewardhackraterising",
             "datasource": DS,
             "targets": [target(worst, ref="A", instant=True, fmt="table"),
                         target(f"max by (run, env) (rlwatch_env_failure_ratio{{{ENV}}})"
                                f" or max by (run, env) (0 * rlwatch_env_episodes{{{ENV}}})",
                                ref="B", instant=True, fmt="table"),
                         target(f"rlwatch_env_truncated_ratio{{{ENV}}}", ref="C", instant=True, fmt="table"),
                         target(f"rlwatch_env_reward_mean{{{ENV}}}", ref="D", instant=True, fmt="table")],
             "transformations": [{"id": "merge", "options": {}},
                                 {"id": "organize", "options": {
                                     "excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True},
                                     "renameByName": {"Value #A": "hack rate", "Value #B": "failure rate",
                                                      "Value #C": "truncated", "Value #D": "reward"}}},
                                 {"id": "sortBy", "options": {"sort": [{"field": "hack rate", "desc": True}]}}],
             "fieldConfig": {"defaults": {"unit": "short"}, "overrides": []}, "options": {"showHeader": True}},
            w=24)

    lay.row("Rollout system: episode durations, phases, launched vs trained (docs/rollout-system.md)")
    p95 = f"sum by (run, env, le) (rate(rlwatch_episode_duration_seconds_bucket{{{ENV}}}[$__rate_interval]))"
    lay.add(timeseries("Episode duration tail", [
        target(f"rlwatch_episode_duration_p50_seconds{{{RUN}}}", "{{run}} p50"),
        target(f"rlwatch_episode_duration_p95_seconds{{{RUN}}}", "{{run}} p95", "B"),
        target(f"rlwatch_episode_duration_max_seconds{{{RUN}}}", "{{run}} slowest", "C"),
        target(f"histogram_quantile(0.95, {p95})", "{{run}} {{env}} p95 (histogram)", "D")],
        describe("episode_duration_p95_seconds", "a tail that moves with the task mix; a synchronous step "
                 "waits for the slowest."), unit="s", log=True))
    lay.add(timeseries("Straggler wait and max / mean", [
        target(f"rlwatch_straggler_wait_seconds{{{RUN}}}", "{{run}} straggler wait (s)"),
        target(f"rlwatch_env_episode_duration_max_over_mean{{{ENV}}}", "{{run}} {{env}} max/mean", "B")],
        describe("straggler_wait_seconds", "a wait that dominates the step: asynchrony or a timeout pays.")))
    lay.add(timeseries("Step phases", [
        target(f"rlwatch_step_phase_seconds{{{RUN}}}", "{{run}} {{phase}}"),
        target(f"rlwatch_step_weight_sync_seconds{{{RUN}}}", "{{run}} weight sync", "B")],
        describe("phase_seconds", "weight sync a fixed floor on every step; generation growing."), unit="s"))
    lay.add(timeseries("Launched vs trained (dropped share by reason)", [
        target(f"sum by (run, run_instance, reason) (rate(rlwatch_episodes_dropped_total{{{ENV}}}[$__rate_interval]))"
               f" / on(run, run_instance) group_left() sum by (run, run_instance) "
               f"(rate(rlwatch_episodes_launched_total{{{ENV}}}[$__rate_interval]))", "{{run}} {{reason}}"),
        target(f"sum by (run, run_instance) (rate(rlwatch_episodes_trained_total{{{ENV}}}[$__rate_interval])) * 3600",
               "{{run}} trained/h", "B")],
        describe("episodes_dropped_total", "failures, timeouts or filters dropping a growing share."),
        unit="percentunit"))
    lay.add(threshold_panel("Length bias: trained shorter than launched",
                            f"1 - rlwatch_length_bias_duration_ratio{{{RUN}}}", "{{run}} duration shortening",
                            "length_bias_max", "length_bias_duration_ratio",
                            "dropping long episodes shortens the trained data.", "RLWatchRolloutLengthBias",
                            unit="percentunit"))
    lay.add(timeseries("Trained vs launched means", [
        target(f"rlwatch_trained_episode_duration_mean_seconds{{{RUN}}}", "{{run}} trained (s)"),
        target(f"rlwatch_launched_episode_duration_mean_seconds{{{RUN}}}", "{{run}} launched (s)", "B"),
        target(f"rlwatch_length_bias_length_ratio{{{RUN}}}", "{{run}} length ratio (trained/launched)", "C")],
        describe("trained_episode_duration_mean_seconds", "trained episodes shorter than launched ones.")))

    lay.row("Trainer dynamics: collapse precursors (what the trainer logs, docs/trainer-dynamics.md)")
    lay.add(threshold_panel("Policy KL between consecutive policies", f"rlwatch_policy_kl{{{RUN}}}", "{{run}}",
                            "policy_kl_floor", "policy_kl", "a climb away from the run's own level.",
                            "RLWatchPolicyKLDeparture", log=True))
    lay.add(timeseries("Gradient norm (0 or non-finite flagged)", [
        target(f"rlwatch_grad_norm{{{RUN}}}", "{{run}} grad norm"),
        target(f"rlwatch_grad_norm_zero{{{RUN}}} + rlwatch_grad_norm_nonfinite{{{RUN}}}", "{{run}} dead (0/NaN)",
               "B"),
        target(f"rlwatch_loss_nonfinite{{{RUN}}}", "{{run}} loss non-finite", "C")],
        describe("grad_norm", "spikes several times the run's level, or a norm stuck at 0 or NaN.",
                 "RLWatchGradNormSpike"), log=True))
    lay.add(timeseries("PPO clip fraction and loss", [
        target(f"rlwatch_clip_fraction{{{RUN}}}", "{{run}} clip fraction"),
        target(f"rlwatch_loss{{{RUN}}}", "{{run}} loss", "B")],
        describe("clip_fraction", "a clip fraction climbing with the policy KL: updates too large.")))
    lay.add(timeseries("Reward, held-out score and entropy", [
        target(f"rlwatch_reward_mean{{{RUN}}}", "{{run}} reward"),
        target(f"rlwatch_heldout_score{{{RUN}}}", "{{run}} held-out", "B"),
        target(f"rlwatch_entropy_mean{{{RUN}}}", "{{run}} entropy", "C")],
        describe("heldout_score", "the score sliding from its peak after entropy or the policy KL moved.",
                 "RLWatchRewardSlide")))

    lay.row("Throughput and the hook itself")
    lay.add(timeseries("Steps per hour and tokens per step", [
        target(f"rate(rlwatch_steps_total{{{RUN}}}[$__rate_interval]) * 3600", "{{run}} steps/h"),
        target(f"rlwatch_step_tokens{{{RUN}}}", "{{run}} tokens/step", "B")],
        "Training pace. Bad: pace dropping to zero (stall) or tokens per step collapsing."))
    lay.add(timeseries("Phase times the trainer reports", [
        target(f'rlwatch_framework_metric{{{RUN}, name=~"(?i).*(time|timing|_s|seconds).*"}}', "{{run}} {{name}}")],
        describe("framework_metric", "one phase (generation, weight sync, update) growing.")))
    lay.add(timeseries("rlwatch compute time per step", [
        target(f"rlwatch_step_hook_compute_seconds{{{RUN}}}", "{{run}} per step"),
        target(f"rlwatch_step_interval_seconds{{{RUN}}}", "{{run}} step interval", "B")],
        describe("hook_compute_seconds", "a hook time that is not small against the step interval."),
        unit="s", log=True))
    lay.add(timeseries("rlwatch errors and store", [
        target(f"sum by (run, stage, kind) (rate(rlwatch_hook_errors_total{{{RUN}}}[$__rate_interval]))",
               "{{run}} {{stage}} {{kind}}"),
        target(f"rlwatch_store_queue_depth{{{RUN}}}", "{{run}} store queue", "B"),
        target(f"rlwatch_store_dropped_steps_total{{{RUN}}}", "{{run}} store dropped", "C")],
        describe("hook_errors_total", "any error rate: some signals are missing.", "RLWatchHookErrors")))

    lay.row("Rollout engine (vLLM metrics, when the engine exports them with a run target label)")
    lay.add(timeseries("vLLM requests running / waiting", [
        target(f"sum by (run) (vllm:num_requests_running{{{RUN}}})", "{{run}} running"),
        target(f"sum by (run) (vllm:num_requests_waiting{{{RUN}}})", "{{run}} waiting", "B")],
        "vLLM's scheduler queue. Bad: waiting requests piling up (stragglers, memory pressure)."))
    lay.add(timeseries("vLLM KV-cache usage and preemptions", [
        target(f"max by (run) (vllm:kv_cache_usage_perc{{{RUN}}} or vllm:gpu_cache_usage_perc{{{RUN}}})",
               "{{run}} KV cache"),
        target(f"sum by (run) (rate(vllm:num_preemptions_total{{{RUN}}}[$__rate_interval]))", "{{run}} preemptions/s",
               "B")],
        "Preemption and recomputation change the sampler's numbers: read next to the mismatch. Bad: KV cache "
        "near 1 with preemptions rising."))
    lay.add(timeseries("vLLM generation tokens vs mismatch", [
        target(f"sum by (run) (rate(vllm:generation_tokens_total{{{RUN}}}[$__rate_interval]))", "{{run}} tokens/s"),
        target(f"rlwatch_mismatch_abs_log_ratio_p99{{{RUN}}}", "{{run}} |Δ log p| p99", "B")],
        "Engine throughput beside the p99 mismatch: a mismatch rising with preemptions points at the engine."))
    return dashboard("rlwatch-details", "rlwatch / details",
                     "Every rlwatch signal by concern: staleness, mismatch, importance sampling, data, "
                     "environments, throughput, the rollout engine.", lay)


DASHBOARDS = {"rlwatch-overview.json": overview, "rlwatch-details.json": details}


def render(make) -> str:
    return json.dumps(make(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--dir", default=str(ROOT / "dashboards"))
    args = parser.parse_args(argv)
    out = Path(args.dir)
    stale = []
    for name, make in DASHBOARDS.items():
        text = render(make)
        path = out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"dashboards out of date: {', '.join(stale)}; run python dashboards/generate.py", file=sys.stderr)
        return 1
    if args.check:
        print(f"dashboards up to date ({len(DASHBOARDS)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

