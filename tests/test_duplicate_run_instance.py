"""One $RLWATCH_RUN_INSTANCE given to two live processes, against a real Prometheus running the shipped
rules: every rule still evaluates (no "found duplicate series"), another run's RLWatchTrainerStalled
still pages, and `rlwatch postmortem --prometheus` keeps the two processes apart, each with its own
alerts (issue 37, item 9)."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request

import pytest

import rlwatch
from rlwatch.alerts import render

from tests.conftest import ROOT, free_port, make_step, need_binary, start_process

STALL_S = 2.0                   # every run's stall bound (a Watch override, exported to the rules)


def _query(url: str, path: str, **params: str) -> dict:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=5) as resp:
        return json.loads(resp.read())["data"]


@pytest.fixture(scope="module")
def duplicated(tmp_path_factory):
    """Prometheus (shipped rules, scrape and evaluation every 250 ms) over three Watches: run "victim"
    and two processes of run "dup" both exporting run_instance "same" (no shared file_sd directory,
    as on two hosts). Each observes 6 steps and then stops. Yields (URL, {name: port})."""
    binary = need_binary("prometheus")
    tmp = tmp_path_factory.mktemp("dup")
    ports = {name: free_port() for name in ("victim", "dup-a", "dup-b")}
    prom_port = free_port()
    (tmp / "prometheus.yml").write_text(render.to_yaml({
        "global": {"scrape_interval": "250ms", "evaluation_interval": "250ms"},
        "rule_files": [str(ROOT / "alerts" / render.RULES_FILE)],
        "scrape_configs": [{"job_name": "rlwatch", "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports.values()]}]}]}))
    prom = start_process([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                          f"--web.listen-address=127.0.0.1:{prom_port}"], prom_port, tmp / "prom.log")
    watches = []
    patch = pytest.MonkeyPatch()
    try:
        for name, port in ports.items():
            if name.startswith("dup"):
                patch.setenv("RLWATCH_RUN_INSTANCE", "same")
            watches.append(rlwatch.Watch(run=name.split("-")[0], port=port, store=None, alerts=False, sd_dir="",
                                         alert_overrides={"stall_seconds": STALL_S}))
        patch.undo()
        assert [w.run_instance for w in watches[1:]] == ["same", "same"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:          # every target scraped before the first step
            up = _query(prom.url, "/api/v1/query", query="sum(up)")["result"]
            if up and up[0]["value"][1] == "3":
                break
            time.sleep(0.2)
        for step in range(6):
            for watch in watches:
                watch.observe(step, **make_step(B=4, T=8, seed=step))
            time.sleep(0.3)
        yield prom.url, ports
    finally:
        patch.undo()
        for watch in watches:
            watch.close()
        prom.stop()


def _firing(url: str, run: str) -> list[dict]:
    return [a["labels"] for a in _query(url, "/api/v1/alerts")["alerts"]
            if a["labels"].get("alertname") == "RLWatchTrainerStalled" and a["labels"].get("run") == run
            and a["state"] == "firing"]


def test_another_runs_stall_pages_and_every_rule_evaluates(duplicated):
    url, ports = duplicated
    deadline = time.monotonic() + 30
    while not (_firing(url, "victim") and len(_firing(url, "dup")) == 2) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert len(_firing(url, "victim")) == 1
    assert sorted(a["instance"] for a in _firing(url, "dup")) == sorted(f"127.0.0.1:{ports[n]}" for n in ("dup-a",
                                                                                                          "dup-b"))
    broken = [(r["name"], r.get("lastError")) for g in _query(url, "/api/v1/rules")["groups"] for r in g["rules"]
              if r.get("health") != "ok"]
    assert broken == []


def test_the_postmortem_keeps_the_two_processes_apart(duplicated, capsys):
    from rlwatch.ops.cli import main

    url, ports = duplicated
    deadline = time.monotonic() + 30
    while len(_firing(url, "dup")) < 2 and time.monotonic() < deadline:
        time.sleep(0.25)
    rc = main(["postmortem", "--prometheus", url, "--run", "dup"])
    err = capsys.readouterr().err
    assert rc == 1 and "2 processes exported run 'dup'; name one with --run-instance" in err, err
    for name in ("dup-a", "dup-b"):
        assert f"same at 127.0.0.1:{ports[name]} (steps 0..5" in err, err
    for name in ("dup-a", "dup-b"):
        rc = main(["postmortem", "--prometheus", url, "--run", "dup", "--run-instance", f"127.0.0.1:{ports[name]}",
                   "--json"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["steps"] == [0, 5], doc["steps"]
        assert [(a["name"], a["labels"]["instance"]) for a in doc["alerts"]] == \
            [("RLWatchTrainerStalled", f"127.0.0.1:{ports[name]}")], doc["alerts"]
