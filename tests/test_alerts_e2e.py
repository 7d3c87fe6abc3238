"""Alerts end to end: a real rlwatch exporter, a real Prometheus with the generated rules scraping it
every second, a real Alertmanager with the example routing and inhibitions, and a webhook
receiver on 127.0.0.1."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlwatch import Watch
from rlwatch.alerts import render

from tests.conftest import free_port, need_binary, start_process

pytestmark = pytest.mark.servers


class Receiver:
    """Records every Alertmanager webhook notification with its arrival time and path."""

    def __init__(self) -> None:
        self.notifications: list[tuple[float, str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.notifications.append((time.time(), self.path, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, name: str | None = None, status: str = "firing"):
        out = []
        for arrived, path, body in list(self.notifications):
            for alert in body["alerts"]:
                if alert["status"] == status and (name is None or alert["labels"]["alertname"] == name):
                    out.append((arrived, path, alert))
        return out

    def wait_for(self, name: str, timeout: float, status: str = "firing"):
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = self.alerts(name, status)
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"{name} not received in {timeout}s; got "
                             f"{[(p, a['labels']['alertname']) for _, p, a in self.alerts(None)]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def alertmanager_config(receiver_port: int) -> str:
    """The example configuration with its receivers pointed at the test receiver."""
    config = render.alertmanager_example()
    base = f"http://127.0.0.1:{receiver_port}"
    config["route"].update(group_wait="1s", group_interval="1s")
    config["receivers"] = [{"name": name, "webhook_configs": [{"url": f"{base}/{name}", "send_resolved": True}]}
                           for name in ("pager", "chat", "heartbeat")]
    return render.to_yaml(config)


@pytest.fixture
def stack(tmp_path: Path, request):
    """Alertmanager + Prometheus (rules loaded, 1 s scrape/eval) + receiver; yields them and the
    exporter's port. Each is stopped (servers by PID) on every path, also when a later one fails to
    start."""
    prometheus_bin = need_binary("prometheus")
    alertmanager_bin = need_binary("prometheus-alertmanager")
    receiver = Receiver()
    request.addfinalizer(receiver.close)
    am_port, prom_port, exporter_port = free_port(), free_port(), free_port()
    (tmp_path / "am.yml").write_text(alertmanager_config(receiver.port))
    alertmanager = start_process([alertmanager_bin, f"--config.file={tmp_path / 'am.yml'}",
                                  f"--storage.path={tmp_path / 'am-data'}",
                                  f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
                                 am_port, tmp_path / "am.log")
    request.addfinalizer(alertmanager.stop)
    # The shipped rules, except that RLWatchExporterDown waits 10 s instead of 1 m so the test stays short
    # (still longer than Prometheus takes to drop a target whose file_sd file was removed: up to ~6 s).
    rules = render.rules_yaml()
    down = rules.index('alert: "RLWatchExporterDown"')
    rules = rules[:down] + rules[down:].replace("[1m]) == 0", "[10s]) == 0", 1)
    (tmp_path / "rules.yaml").write_text(rules)
    sd_dir = tmp_path / "targets"
    sd_dir.mkdir()
    (tmp_path / "prometheus.yml").write_text(render.to_yaml({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": "rlwatch", "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]},
                           {"job_name": "rlwatch-sd", "honor_labels": True,
                            "file_sd_configs": [{"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}]}],
    }))
    prometheus = start_process([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                                f"--web.listen-address=127.0.0.1:{prom_port}", "--rules.alert.resend-delay=1s"],
                               prom_port, tmp_path / "prometheus.log")
    request.addfinalizer(prometheus.stop)              # finalizers run last-added first
    yield dict(receiver=receiver, exporter_port=exporter_port, prometheus=prometheus, alertmanager=alertmanager,
               sd_dir=sd_dir)


class Trainer(threading.Thread):
    """Observes a step every 0.2 s; k3 = e^r - 1 - r for a constant per-token log-ratio r."""

    def __init__(self, watch: Watch, r: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.watch, self.r, self.running, self.step = watch, r, True, 0

    def run(self) -> None:
        while self.running:
            self.watch.observe(self.step, mask=[[1] * 8] * 4, sampler_logp=[[-1.0] * 8] * 4,
                               trainer_logp=[[-1.0 + self.r] * 8] * 4, token_version=[[self.step] * 8] * 4,
                               trainer_version=self.step)
            self.step += 1
            time.sleep(0.2)


def query(prometheus, expr: str) -> list:
    url = prometheus.url + "/api/v1/query?query=" + urllib.request.quote(expr)
    return json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]


def wait_scraped(prometheus, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if query(prometheus, 'rlwatch_steps_total{run="e2e"}'):
            return
        time.sleep(0.2)
    raise AssertionError("Prometheus never scraped the exporter")


def test_kl_spike_pages_within_15_seconds(stack):
    receiver, prometheus = stack["receiver"], stack["prometheus"]
    with Watch(run="e2e", port=stack["exporter_port"], store=None, alerts=False) as watch:
        trainer = Trainer(watch, r=0.01)
        trainer.start()
        wait_scraped(prometheus)
        time.sleep(6)                       # quiet steps: nothing critical may arrive
        trainer.r = 0.6                      # k3 = e^0.6 - 1.6 = 0.22 > 0.1
        spike = time.time()
        arrived, path, alert = receiver.wait_for("RLWatchKLSpike", timeout=15)
        trainer.running = False
        trainer.join()
    assert arrived - spike <= 15
    assert path == "/pager"                                   # critical routes to the pager receiver
    assert alert["labels"]["run"] == "e2e" and alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"].endswith("/runbook#rlwatchklspike")
    expected = math.exp(0.6) - 1.6
    assert f"{expected:.4g}" in alert["annotations"]["description"]
    early = [(p, a["labels"]["alertname"]) for t, p, a in receiver.alerts(None)
             if t < spike and a["labels"].get("severity") == "critical"]
    assert early == []
    assert receiver.alerts("RLWatchWatchdog"), "the watchdog alert proves the pipeline end to end"
    assert all(p == "/heartbeat" for _, p, _ in receiver.alerts("RLWatchWatchdog"))


def test_stalled_trainer_then_exporter_down(stack):
    receiver, prometheus = stack["receiver"], stack["prometheus"]
    watch = Watch(run="e2e", port=stack["exporter_port"], store=None, alerts=False,
                  alert_overrides={"stall_seconds": 3})
    trainer = Trainer(watch)
    trainer.start()
    wait_scraped(prometheus)
    trainer.running = False                   # the loop hangs; the process (and exporter) stay up
    trainer.join()
    stopped = time.time()
    arrived, path, alert = receiver.wait_for("RLWatchTrainerStalled", timeout=20)
    assert alert["labels"]["run"] == "e2e" and path == "/pager" and arrived - stopped >= 3
    watch.close()                              # the exporter goes away
    closed = time.time()
    arrived, path, alert = receiver.wait_for("RLWatchExporterDown", timeout=25)
    assert alert["labels"]["job"] == "rlwatch" and arrived > closed and path == "/pager"


def test_exporter_down_only_for_a_registered_exporter_that_crashed(stack):
    """A run that closes cleanly unregisters and never pages; a target that never answered is not
    an outage; an exporter that answered and died with its registration in place pages."""
    receiver, prometheus, sd_dir = stack["receiver"], stack["prometheus"], stack["sd_dir"]
    never = free_port()
    (sd_dir / "never-up.json").write_text(json.dumps([{"targets": [f"127.0.0.1:{never}"], "labels": {"run": "ghost"}}]))
    clean = Watch(run="clean", port=0, store=None, alerts=False, sd_dir=str(sd_dir))
    crashed = Watch(run="crashed", port=0, store=None, alerts=False, sd_dir=str(sd_dir))
    for watch in (clean, crashed):
        watch.observe(0, mask=[[1] * 8], sampler_logp=[[-1.0] * 8], trainer_logp=[[-1.0] * 8])
    deadline = time.time() + 20
    while time.time() < deadline and len(query(prometheus, 'up{job="rlwatch-sd"} == 1')) < 2:
        time.sleep(0.2)
    assert len(query(prometheus, 'up{job="rlwatch-sd"} == 1')) == 2
    clean.close()                           # unregisters, then stops serving
    crashed.server.close()                  # dies: its registration stays behind
    arrived, path, alert = receiver.wait_for("RLWatchExporterDown", timeout=25)
    assert alert["labels"]["run"] == "crashed" and path == "/pager"
    time.sleep(3)
    runs = {a["labels"].get("run") for _, _, a in receiver.alerts("RLWatchExporterDown")}
    assert runs == {"crashed"}, runs        # neither the clean run nor the never-up target
    crashed.registration.remove()
    crashed.close()


def test_inhibitions_never_silence_the_watchdog(stack):
    """An ExporterDown without a run label (a static target) must not inhibit the Watchdog, which
    has no run label either (Alertmanager treats two missing labels as equal)."""
    am = stack["alertmanager"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    alerts = [
        {"labels": {"alertname": "RLWatchExporterDown", "severity": "critical", "instance": "127.0.0.1:3",
                    "job": "rlwatch"}, "startsAt": now},
        {"labels": {"alertname": "RLWatchWatchdog", "severity": "none"}, "startsAt": now},
        {"labels": {"alertname": "RLWatchHookErrors", "severity": "warning", "run": "r7", "stage": "export",
                    "kind": "x"}, "startsAt": now},
    ]
    request = urllib.request.Request(am.url + "/api/v2/alerts", data=json.dumps(alerts).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=5)
    time.sleep(3)                           # inhibitions apply at once; give them time to be wrong
    got = json.loads(urllib.request.urlopen(am.url + "/api/v2/alerts", timeout=5).read())
    states = {a["labels"]["alertname"]: a["status"]["state"] for a in got}
    assert states["RLWatchWatchdog"] == "active", states
    assert states["RLWatchHookErrors"] == "active", states


def test_a_down_exporter_inhibits_the_alerts_of_its_run(stack):
    """The example Alertmanager configuration: ExporterDown silences the same run's alerts."""
    am = stack["alertmanager"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    alerts = [
        {"labels": {"alertname": "RLWatchExporterDown", "severity": "critical", "run": "r9",
                    "instance": "127.0.0.1:1", "job": "rlwatch"}, "startsAt": now},
        {"labels": {"alertname": "RLWatchKLSpike", "severity": "critical", "run": "r9",
                    "instance": "127.0.0.1:1", "job": "rlwatch"}, "startsAt": now},
        {"labels": {"alertname": "RLWatchKLSpike", "severity": "critical", "run": "other",
                    "instance": "127.0.0.1:2", "job": "rlwatch"}, "startsAt": now},
    ]
    request = urllib.request.Request(am.url + "/api/v2/alerts", data=json.dumps(alerts).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=5)
    deadline = time.time() + 10
    states = {}
    while time.time() < deadline:
        got = json.loads(urllib.request.urlopen(am.url + "/api/v2/alerts", timeout=5).read())
        states = {(a["labels"]["alertname"], a["labels"]["run"]): a["status"]["state"] for a in got}
        if states.get(("RLWatchKLSpike", "r9")) == "suppressed":
            break
        time.sleep(0.2)
    assert states[("RLWatchKLSpike", "r9")] == "suppressed"
    assert states[("RLWatchKLSpike", "other")] == "active"
    assert states[("RLWatchExporterDown", "r9")] == "active"
