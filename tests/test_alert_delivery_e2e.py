"""Alert delivery end to end with real servers on 127.0.0.1: Prometheus scraping every 10 s while
steps come every 0.05 s, two exporters sharing one run name, a real Alertmanager (or a two-node
cluster behind two Prometheus replicas, the configuration of ``examples/deploy/ha/``) and a webhook
receiver. An 8-step burst far above the KLSpike bound opens and resolves between two scrapes; it
must arrive exactly once, for its own process, and the healthy twin must page nothing."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from rlwatch import Watch
from rlwatch.alerts import render

from tests.conftest import ROOT, free_port, need_binary, start_process
from tests.test_alerts_e2e import Receiver, alertmanager_config, query

pytestmark = pytest.mark.servers

HA = ROOT / "examples" / "deploy" / "ha"
SCRAPE_SECONDS = 10


class Trainer(threading.Thread):
    """A step every 0.05 s with k3 = e^r - 1 - r for a constant per-token log-ratio r (r = 0.01:
    healthy); :meth:`burst` makes the next ``steps`` steps r = 1.5 (k3 = 1.98, 20x the 0.1 bound)."""

    def __init__(self, watch: Watch) -> None:
        super().__init__(daemon=True)
        self.watch, self.running, self.step, self._burst = watch, True, 0, 0
        self.burst_done = threading.Event()

    def burst(self, steps: int = 8) -> None:
        self._burst = steps

    def run(self) -> None:
        while self.running:
            r = 1.5 if self._burst else 0.01
            self.watch.observe(self.step, mask=[[1] * 8] * 4, sampler_logp=[[-1.0] * 8] * 4,
                               trainer_logp=[[-1.0 + r] * 8] * 4, token_version=[[self.step] * 8] * 4,
                               trainer_version=self.step)
            if self._burst:
                self._burst -= 1
                if not self._burst:
                    self.burst_done.set()
            self.step += 1
            time.sleep(0.05)

    def stop(self) -> None:
        self.running = False
        self.join(timeout=10)


def _prometheus_config(example: dict, rules: Path, sd_dir: Path, alertmanagers: list[int]) -> str:
    """The shipped HA Prometheus configuration pointed at this test's files and ports (10 s scrapes;
    rules evaluated every second so that the test stays short)."""
    config = json.loads(json.dumps(example))
    config["global"].update(scrape_interval=f"{SCRAPE_SECONDS}s", evaluation_interval="1s")
    config["rule_files"] = [str(rules)]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [
        {"targets": [f"127.0.0.1:{port}" for port in alertmanagers]}]
    job = config["scrape_configs"][0]
    job["file_sd_configs"] = [{"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}]
    return yaml.safe_dump(config)


@pytest.fixture
def servers(tmp_path: Path, request):
    """``servers(prometheus=N, alertmanagers=M)``: M Alertmanagers (a gossip cluster on 127.0.0.1
    when M > 1), N Prometheus replicas with the generated rules and the HA example's configuration,
    a receiver; every server stopped by PID."""
    prometheus_bin = need_binary("prometheus")
    alertmanager_bin = need_binary("prometheus-alertmanager")

    def start(prometheus: int = 1, alertmanagers: int = 1) -> dict:
        receiver = Receiver()
        request.addfinalizer(receiver.close)
        (tmp_path / "am.yml").write_text(alertmanager_config(receiver.port))
        web = [free_port() for _ in range(alertmanagers)]
        gossip = [free_port() for _ in range(alertmanagers)]
        ams = []
        for i in range(alertmanagers):
            cluster = ([f"--cluster.listen-address=127.0.0.1:{gossip[i]}", "--cluster.peer-timeout=3s",
                        *[f"--cluster.peer=127.0.0.1:{gossip[j]}" for j in range(alertmanagers) if j != i]]
                       if alertmanagers > 1 else ["--cluster.listen-address="])
            am = start_process([alertmanager_bin, f"--config.file={tmp_path / 'am.yml'}",
                                f"--storage.path={tmp_path / f'am{i}-data'}",
                                f"--web.listen-address=127.0.0.1:{web[i]}", *cluster], web[i], tmp_path / f"am{i}.log")
            request.addfinalizer(am.stop)
            ams.append(am)
        (tmp_path / "rules.yaml").write_text(render.rules_yaml())
        sd_dir = tmp_path / "targets"
        sd_dir.mkdir()
        example = yaml.safe_load((HA / "prometheus.yml").read_text())
        (tmp_path / "prometheus.yml").write_text(_prometheus_config(example, tmp_path / "rules.yaml", sd_dir, web))
        proms = []
        for i in range(prometheus):
            port = free_port()
            prom = start_process([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                                  f"--storage.tsdb.path={tmp_path / f'prom{i}-data'}",
                                  f"--web.listen-address=127.0.0.1:{port}"], port, tmp_path / f"prom{i}.log")
            request.addfinalizer(prom.stop)
            proms.append(prom)
        return dict(receiver=receiver, prometheus=proms, alertmanagers=ams, sd_dir=sd_dir)

    return start


def _twins(sd_dir: Path, request) -> tuple[Watch, Watch]:
    watches = tuple(Watch(run="twin", port=0, store=None, alerts=True, sd_dir=str(sd_dir)) for _ in range(2))
    for watch in watches:
        request.addfinalizer(watch.close)
    assert watches[0].run_instance != watches[1].run_instance
    return watches


def _wait_scraped(prometheus, count: int, timeout: float = 40) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(query(prometheus, 'rlwatch_steps_total{run="twin"}')) == count:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus did not scrape {count} exporters of run twin")


def _pages(receiver: Receiver) -> list[tuple[str, dict]]:
    """(path, alert) of every firing alert notified, Watchdog heartbeats left out."""
    return [(path, alert) for _, path, alert in receiver.alerts(None)
            if alert["labels"]["alertname"] != "RLWatchWatchdog"]


def _wait_page(receiver: Receiver, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not _pages(receiver):
        time.sleep(0.2)


def _rule_errors(prometheus) -> list[str]:
    body = json.loads(urllib.request.urlopen(prometheus.url + "/api/v1/rules", timeout=5).read())
    return [f"{rule['name']}: {rule.get('lastError')}" for group in body["data"]["groups"]
            for rule in group["rules"] if rule.get("health") != "ok"]


def _check_one_page(stack: dict, sick: Watch, healthy: Watch) -> None:
    receiver = stack["receiver"]
    pages = _pages(receiver)
    for _, path, body in receiver.notifications:        # what arrived (shown with pytest -s)
        print(path, [(a["status"], a["labels"]["alertname"], a["labels"].get("run_instance"),
                      a["labels"].get("incident")) for a in body["alerts"]])
    identity = ("alertname", "run", "run_instance", "incident", "severity")
    critical = [(path, {k: a["labels"].get(k) for k in identity}) for path, a in pages
                if a["labels"]["severity"] == "critical"]
    notifications = [body for _, path, body in receiver.notifications if path == "/pager"]
    assert critical == [("/pager", {"alertname": "RLWatchKLSpike", "run": "twin", "run_instance": sick.run_instance,
                                    "incident": "1", "severity": "critical"})], pages
    assert len(notifications) == 1, notifications
    assert not [a for _, a in pages if a["labels"].get("run_instance") == healthy.run_instance], pages
    for prometheus in stack["prometheus"]:
        assert _rule_errors(prometheus) == []
    events = [e for e in sick.evaluator.events if e.name == "RLWatchKLSpike" and e.state == "firing"]
    assert len(events) == 1 and not [e for e in healthy.evaluator.events if e.severity == "critical"]


def _burst_between_scrapes(stack: dict, request, close_after: float | None = None) -> tuple[Watch, Watch]:
    sick, healthy = _twins(stack["sd_dir"], request)
    trainers = [Trainer(sick), Trainer(healthy)]
    for trainer in trainers:
        trainer.start()
        request.addfinalizer(trainer.stop)
    for prometheus in stack["prometheus"]:
        _wait_scraped(prometheus, 2)
    scraped = len(sick.exposition.scrape_times) and sick.exposition.scrape_times[-1]
    deadline = time.time() + 2 * SCRAPE_SECONDS
    while time.time() < deadline and sick.exposition.scrape_times[-1] == scraped:
        time.sleep(0.05)
    trainers[0].burst(8)                    # just after a scrape: it opens and resolves (~1.2 s) before the next
    assert trainers[0].burst_done.wait(10)
    if close_after is not None:
        time.sleep(close_after)
        trainers[0].stop()
        sick.close()
    _wait_page(stack["receiver"], timeout=3 * SCRAPE_SECONDS)
    time.sleep(8)                           # a duplicate (another replica, another incident) would come now
    return sick, healthy


def test_a_burst_between_scrapes_pages_once_for_its_own_process(servers, request):
    stack = servers()
    sick, healthy = _burst_between_scrapes(stack, request)
    _check_one_page(stack, sick, healthy)
    seen = query(stack["prometheus"][0], 'count_over_time(rlwatch_alert_incident{alert="RLWatchKLSpike"}[5m])')
    assert [s["metric"]["state"] for s in seen] == ["resolved"]      # no scrape saw it open


def test_a_burst_right_before_the_run_closes_still_pages_once(servers, request):
    stack = servers()
    sick, healthy = _burst_between_scrapes(stack, request, close_after=1.0)
    _check_one_page(stack, sick, healthy)


def test_ha_pair_of_prometheus_and_alertmanager_cluster_notifies_once(servers, request):
    stack = servers(prometheus=2, alertmanagers=2)
    sick, healthy = _burst_between_scrapes(stack, request)
    _check_one_page(stack, sick, healthy)
