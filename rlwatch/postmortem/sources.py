"""Load a finished (or running) run into one shape, whatever recorded it.

Sources: an rlwatch run store; a TRL output directory (``checkpoint-N/trainer_state.json`` log
history, plus a run store when one is there); a verl checkpoint directory with the file logger's
JSONL; a live Prometheus (range queries for one run). Each becomes a :class:`RunData`: per-step
values keyed like the signals (``{name: {labels: value}}``), alert events, checkpoints.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..metrics import CATALOGUE

Values = dict[str, dict[tuple[str, ...], float | None]]

# Framework scalars that measure the policy's real quality, best first.
QUALITY_KEYS = ("heldout_true_reward", "eval/true_reward", "eval_reward", "eval/reward", "val/test_score",
                "val-core/reward", "heldout_reward")


@dataclass
class RunData:
    run: str
    source: str
    steps: list[tuple[int, Values]] = field(default_factory=list)
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[tuple[int, str]] = field(default_factory=list)
    hack_examples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def series(self, name: str, labels: tuple[str, ...] = ()) -> list[tuple[int, float]]:
        out = [(s, v) for s, values in self.steps if (v := values.get(name, {}).get(labels)) is not None]
        if not out and not labels and name in self.scalars:
            out = list(self.scalars[name])
        return out

    def label_sets(self, name: str) -> set[tuple[str, ...]]:
        return {labels for _, values in self.steps for labels in values.get(name, {})}


# --- rlwatch run store ------------------------------------------------------------------------------

def from_store(path: str | Path, run: str | None = None) -> RunData:
    from ..store import StoreReader

    with StoreReader(str(path)) as store:
        runs = store.runs()
        if not runs:
            raise ValueError(f"{path}: the store holds no run")
        if run is None:
            run = runs[-1]
        elif run not in runs:
            raise ValueError(f"{path}: no run {run!r} (runs: {', '.join(runs)})")
        data = RunData(run=run, source=f"store {path}")
        data.steps = [(row.step, row.values) for row in store.steps(run)]
        data.scalars = store.scalars(run)
        data.alerts = store.alerts(run)
        data.checkpoints = store.checkpoints(run)
        data.events = store.events(run)
        data.meta = store.meta(run)
        try:
            data.hack_examples = store.hack_examples(run)
        except Exception:  # noqa: BLE001 - a store written before hack examples existed
            data.hack_examples = []
    return data


# --- TRL output directory -----------------------------------------------------------------------------

TRL_KEYS = {   # TRL log key -> rlwatch signal (where the meaning coincides)
    "reward": "reward_mean", "reward_std": "reward_std", "entropy": "entropy_mean",
    "completions/clipped_ratio": "truncated_ratio", "completions/mean_length": "response_length_mean",
    "completions/max_length": "response_length_max",
}


def from_trl(directory: str | Path) -> RunData:
    directory = Path(directory)
    checkpoints = sorted(((int(m.group(1)), p) for p in directory.glob("checkpoint-*")
                          if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name))))
    stores = sorted(directory.glob("*.db")) + sorted(directory.glob("rlwatch*/*.db"))
    data = from_store(stores[0]) if stores else RunData(run=directory.name, source=f"TRL {directory}")
    data.source = f"TRL {directory}" + (f" + store {stores[0]}" if stores else "")
    history: list[dict] = []
    if checkpoints:
        state = checkpoints[-1][1] / "trainer_state.json"
        if state.exists():
            history = json.loads(state.read_text()).get("log_history", [])
    by_step: dict[int, Values] = {s: v for s, v in data.steps}
    for entry in history:
        step = entry.get("step")
        if step is None:
            continue
        for key, value in entry.items():
            if not isinstance(value, (int, float)) or key == "step":
                continue
            data.scalars.setdefault(key, []).append((int(step), float(value)))
            if key in TRL_KEYS and not data.steps:
                by_step.setdefault(int(step), {})[TRL_KEYS[key]] = {(): float(value)}
    if not data.steps:
        data.steps = sorted(by_step.items())
    known = {p for _, p in data.checkpoints}
    data.checkpoints += [(s, str(p)) for s, p in checkpoints if str(p) not in known]
    data.checkpoints.sort()
    return data


# --- verl checkpoint directory + file logger JSONL ----------------------------------------------------

VERL_KEYS = {
    "rollout_corr/kl": "mismatch_kl_k1", "rollout_corr/k3_kl": "mismatch_kl_k3",
    "rollout_corr/chi2_token": "mismatch_chi2_token", "rollout_corr/chi2_seq": "mismatch_chi2_sequence",
    "rollout_corr/rollout_is_eff_sample_size": "is_ess_ratio",
    "rollout_corr/rollout_is_ratio_fraction_high": "is_tis_high_ratio",
    "rollout_corr/rollout_is_ratio_fraction_low": "is_tis_low_ratio",
    "critic/score/mean": "reward_mean", "actor/entropy": "entropy_mean",
    "response_length/mean": "response_length_mean", "response_length/max": "response_length_max",
    "training/off_policy/trajectory_staleness/mean": "version_lag_mean",
    "training/off_policy/trajectory_staleness/max": "version_lag_max",
}


def from_verl(directory: str | Path) -> RunData:
    directory = Path(directory)
    logs = sorted(directory.rglob("*.jsonl"))
    stores = sorted(directory.rglob("*.db"))
    data = from_store(stores[0]) if stores else RunData(run=directory.name, source=f"verl {directory}")
    data.source = f"verl {directory}" + (f" + store {stores[0]}" if stores else "")
    by_step: dict[int, Values] = {}
    for log in logs:
        for line in log.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(entry, dict) or "step" not in entry:
                continue
            step, payload = int(entry["step"]), entry.get("data", entry)
            for key, value in payload.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    data.scalars.setdefault(key, []).append((step, float(value)))
                    if key in VERL_KEYS:
                        by_step.setdefault(step, {})[VERL_KEYS[key]] = {(): float(value)}
    if not data.steps:
        data.steps = sorted(by_step.items())
    for path in directory.glob("global_step_*"):
        m = re.fullmatch(r"global_step_(\d+)", path.name)
        if m and path.is_dir():
            data.checkpoints.append((int(m.group(1)), str(path)))
    data.checkpoints = sorted(set(data.checkpoints))
    return data


# --- a live Prometheus -----------------------------------------------------------------------------

def _prom(url: str, path: str, **params: Any) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url.rstrip('/')}{path}?{query}", timeout=30) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus: {body}")
    return body["data"]


def from_prometheus(url: str, run: str, lookback_seconds: float = 7 * 86400, step_seconds: float = 15.0,
                    end: float | None = None) -> RunData:
    """Range queries for every gauge of one run over the lookback window, aligned on the run's own
    step series (a resolution of at most 11,000 points per series, Prometheus' limit)."""
    import time

    data = RunData(run=run, source=f"Prometheus {url}")
    if not _prom(url, "/api/v1/series", **{"match[]": f'rlwatch_step{{run="{run}"}}'}):
        raise ValueError(f"Prometheus at {url} has no series for run {run!r}")
    end = end or time.time()
    start = end - lookback_seconds
    step = max(step_seconds, lookback_seconds / 10000)

    def range_query(expr: str) -> list[dict]:
        return _prom(url, "/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    step_at: dict[float, int] = {}
    for series in range_query(f'rlwatch_step{{run="{run}"}}'):
        for ts, value in series["values"]:
            step_at[float(ts)] = int(float(value))
    by_step: dict[int, Values] = {}
    for spec in CATALOGUE:
        if spec.kind != "gauge" or spec.group in ("config",):
            continue
        for series in range_query(f'{spec.full_name}{{run="{run}"}}'):
            labels = tuple(series["metric"].get(label, "") for label in spec.labels)
            for ts, value in series["values"]:
                s = step_at.get(float(ts))
                v = float(value)
                if s is not None and math.isfinite(v):
                    by_step.setdefault(s, {}).setdefault(spec.name, {})[labels] = v
    data.steps = sorted(by_step.items())
    for series in range_query(f'ALERTS{{run="{run}", alertstate="firing"}}'):
        firing = [float(ts) for ts, _ in series["values"]]
        if not firing:
            continue
        labels = {k: v for k, v in series["metric"].items() if k not in ("__name__", "alertstate")}
        at = min(firing)
        data.alerts.append(dict(name=labels.pop("alertname", "?"), severity=labels.pop("severity", ""),
                                state="firing", step=step_at.get(at), time=at, labels=labels))
    for name, points in _framework_scalars(range_query, run, step_at).items():
        data.scalars[name] = points
    return data


def _framework_scalars(range_query: Any, run: str, step_at: dict[float, int]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for series in range_query(f'rlwatch_framework_metric{{run="{run}"}}'):
        name = series["metric"].get("name", "")
        for ts, value in series["values"]:
            s = step_at.get(float(ts))
            if s is not None:
                out.setdefault(name, []).append((s, float(value)))
    return out


def load(path: str | None = None, prometheus: str | None = None, run: str | None = None) -> RunData:
    """Detect the kind of ``path`` (or query ``prometheus`` for ``run``) and load it."""
    if prometheus:
        if not run:
            raise ValueError("--prometheus needs --run")
        return from_prometheus(prometheus, run)
    if path is None:
        raise ValueError("give a run store, a TRL output directory, a verl checkpoint directory, or --prometheus")
    p = Path(path)
    if p.is_file():
        return from_store(p, run)
    if not p.is_dir():
        raise FileNotFoundError(path)
    if any(p.glob("checkpoint-*/trainer_state.json")):
        return from_trl(p)
    if any(p.glob("global_step_*")) or any(p.rglob("*.jsonl")):
        return from_verl(p)
    stores = sorted(p.glob("*.db"))
    if stores:
        return from_store(stores[0], run)
    raise ValueError(f"{path}: not a run store, TRL output directory or verl checkpoint directory")
