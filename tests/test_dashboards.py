"""Dashboards: generated JSON up to date, sound structure, and every panel proven against a real
Prometheus that scraped a real rlwatch run (with the rlwatch rules loaded)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from rlwatch import Watch
from rlwatch.core import metrics
from rlwatch.alerts import render

from tests.conftest import ROOT, free_port, make_step, need_binary, start_process

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
EXTERNAL = {"ALERTS", "up"}                     # Prometheus' own series
VLLM = re.compile(r"vllm:[a-z_]+")              # the rollout engine's metrics, not rlwatch's


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def all_targets(dash: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in panels(dash) for t in p.get("targets", [])]


def test_generator_check_passes():
    result = subprocess.run([sys.executable, str(ROOT / "dashboards" / "generate.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert len(DASHBOARDS) == 2


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_structure(path):
    dash = load(path)
    assert dash["schemaVersion"] == 39
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "run", "run_instance", "env"]
    run_var = dash["templating"]["list"][1]
    assert run_var["multi"] and run_var["includeAll"]
    for panel, target in all_targets(dash):
        assert target["refId"], panel["title"]
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert 'run=~"$run", run_instance=~"$run_instance"' in target["expr"], (panel["title"], target["expr"])
    for panel in panels(dash):
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert len(panel.get("description", "")) > 40, panel["title"]
        uses_env = any("env" in t["expr"] and "env_" in t["expr"] for t in panel["targets"])
        if uses_env and "rlwatch_env_" in json.dumps(panel["targets"]):
            assert any('env=~"$env"' in t["expr"] for t in panel["targets"]), panel["title"]
    # No two panels overlap on the grid.
    cells = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
        assert g["x"] + g["w"] <= 24


def test_dashboard_uids_are_unique():
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


def test_alert_runbooks_are_linked_from_panels():
    text = "".join(p.read_text() for p in DASHBOARDS)
    for alert in ("RLWatchKLSpike", "RLWatchESSLow", "RLWatchRewardHackRateRising", "RLWatchMismatchDrift"):
        assert f"/runbook#{alert.lower()}" in text


def substitute(expr: str, run: str) -> str:
    return (expr.replace("$run_instance", ".*").replace("$run", run).replace("$env", ".*")
            .replace("$__rate_interval", "10s").replace("$__interval", "1s"))


def drive_full_run(watch: Watch, steps: int = 34, before_spike=None) -> None:
    """A run touching every signal family: mismatch, lag (partial rollouts), groups, envs, hacks,
    failures, entropy, sampler settings, framework scalars, a bad field, then a KL spike
    (``before_spike()`` is called just before it: k3's forecast exists only while k3 is below its bound)."""
    for step in range(steps):
        record = make_step(B=32, T=24, seed=step, lag_max=3, noise=0.05 + 0.002 * step,
                           envs=("math", "code"), group=4)
        B, T = record["mask"].shape
        version = record["token_version"].clone()
        version[:, T // 2:] = (version[:, T // 2:] + 1).clamp(max=10)       # partial rollouts
        durations = torch.exp(torch.randn(B, generator=torch.Generator().manual_seed(step))) * 60
        record.update(durations=durations, phases={"generation": 3.0, "training": 1.0, "sync": 0.2},
                      dropped_reasons=["timeout", "filtered"], dropped_durations=[900.0, 20.0],
                      dropped_lengths=[24, 3], dropped_env=["math", "code"])
        record.update(token_version=version, trainer_version=10,
                      entropy=torch.rand(B, T) + 0.5, temperature=1.0, top_p=1.0, top_k=-1,
                      logprobs_mode="processed_logprobs",
                      hacked={"verifier": torch.arange(B) % 8 == 0}, failed=[None] * (B - 1) + ["timeout"])
        record["sampler_logp"][0, 0] = float("-inf")                        # one non-finite token
        if step == steps - 4 and before_spike is not None:
            before_spike()
        if step >= steps - 4:                                                 # a KL spike fires an alert
            record["trainer_logp"] = record["sampler_logp"].nan_to_num(neginf=-5.0) + 0.8
        if step == steps // 2:
            watch.observe(step, mask=torch.ones(2, 2), sampler_logp=torch.zeros(2, 3))   # a hook error
        watch.observe(step, **record)
        watch.log_scalars(step, {"timing_s/gen": 0.5 + 0.01 * step, "actor/grad_norm": 1.0, "actor/ppo_kl": 0.01,
                                 "actor/pg_clipfrac": 0.1, "actor/pg_loss": 0.2, "val-core/math/acc/mean@4": 0.5})
        time.sleep(0.35)


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    prometheus_bin = need_binary("prometheus")
    tmp = tmp_path_factory.mktemp("dash")
    exporter_port, prom_port = free_port(), free_port()
    (tmp / "rules.yaml").write_text(render.rules_yaml())
    (tmp / "prometheus.yml").write_text(render.to_yaml({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [{"job_name": "rlwatch", "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]}]}))
    prom = start_process([prometheus_bin, f"--config.file={tmp / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                         prom_port, tmp / "prometheus.log")
    start = time.time()
    try:
        with Watch(run="dash-run", port=exporter_port, store=str(tmp / "run.db"), alerts=False) as watch:
            rising = []                                     # the exposition while k3 climbs (its forecast)
            drive_full_run(watch, before_spike=lambda: rising.append(
                urllib.request.urlopen(watch.url, timeout=5).read().decode()))
            time.sleep(3)                                   # a few more scrapes and rule evaluations
            exposition = urllib.request.urlopen(watch.url, timeout=5).read().decode()
            time.sleep(2.5)                                 # longer than a scrape may take (timeout 1 s)
            end = last_good_scrape(prom.url, time.time())
        yield dict(url=prom.url, start=start, end=end, exposition=exposition, rising=rising[0], run="dash-run")
    finally:
        prom.stop()


def last_good_scrape(url: str, now: float, window_s: int = 5) -> float:
    """The time of the latest scrape of the run that succeeded (``up`` == 1) in the last ``window_s``.

    Instant queries are asked at this time, not at ``now``: a failed scrape (one cut by the exporter's
    close, or past the 1 s timeout on a loaded machine) writes staleness markers at its start, and an
    instant query after it sees no gauge at all, while range queries are unaffected."""
    samples = prom_get(url, "/api/v1/query", query=f'up{{job="rlwatch"}}[{window_s}s]', time=now)["result"]
    good = [float(ts) for series in samples for ts, value in series["values"] if value == "1"]
    assert good, f"no successful scrape in the last {window_s} s: {samples}"
    return max(good) + 0.001


def prom_get(url: str, path: str, **params) -> dict:
    query = urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(f"{url}{path}?{query}", timeout=10) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{params}: {exc.read().decode()}") from None
    assert body["status"] == "success", body
    return body["data"]


def test_every_metric_name_is_exported_by_a_live_run(scraped_run):
    live = {line.split("{")[0].split(" ")[0] for text in (scraped_run["exposition"], scraped_run["rising"])
            for line in text.splitlines() if line and not line.startswith("#")}
    recorded = {name for name, _ in render.RECORDING_RULES}
    assert live <= metrics.exported_names()
    exprs = [t["expr"] for p in DASHBOARDS for _, t in all_targets(load(p))]
    exprs += [a["expr"] for p in DASHBOARDS for a in load(p)["annotations"]["list"] if "expr" in a]
    exprs += [a.expr for a in render.ALERTS] + [e for _, e in render.RECORDING_RULES]
    used = set()
    for expr in exprs:
        expr = VLLM.sub("", expr)
        used |= set(re.findall(r"\b(rlwatch_[a-z0-9_]+|[a-z_]+:rlwatch_[a-z0-9_]+:[a-z0-9_]+|ALERTS|up)\b", expr))
    unknown = {n for n in used if n not in live and n not in recorded and n not in EXTERNAL}
    assert not unknown, f"names no live run exports: {sorted(unknown)}"


def test_every_panel_query_returns_data(scraped_run):
    url, run = scraped_run["url"], scraped_run["run"]
    start, end = scraped_run["start"], scraped_run["end"]
    empty = []
    checked = 0
    for path in DASHBOARDS:
        dash = load(path)
        for panel, target in all_targets(dash):
            if VLLM.search(target["expr"]):
                continue      # vLLM's own metrics: only present when an engine exports them (not on CPU)
            expr = substitute(target["expr"], run)
            if target.get("instant"):
                result = prom_get(url, "/api/v1/query", query=expr, time=end)["result"]
            else:
                result = prom_get(url, "/api/v1/query_range", query=expr, start=start, end=end, step=1)["result"]
            checked += 1
            if not result:
                empty.append(f"{path.name}: {panel['title']} [{target['refId']}] {expr}")
        for annotation in dash["annotations"]["list"]:
            if "expr" in annotation:
                expr = substitute(annotation["expr"], run)
                if not prom_get(url, "/api/v1/query_range", query=expr, start=start, end=end, step=1)["result"]:
                    empty.append(f"{path.name}: annotation {expr}")
    assert not empty, "\n".join(empty)
    assert checked > 60
    runs = prom_get(url, "/api/v1/series", **{"match[]": "rlwatch_step"})
    assert {s["run"] for s in runs} == {run}          # the run variable's query
