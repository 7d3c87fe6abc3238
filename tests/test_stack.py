"""`rlwatch up` / `rlwatch down` with the real servers, and service discovery of exporters that Ray
placed in an actor: Prometheus scrapes them without a hand-written target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlwatch import Watch
from rlwatch.runs.stack import running

from tests.conftest import free_port, make_step, need_binary, need_module

pytestmark = pytest.mark.servers


def rlwatch_cli(*args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlwatch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def prom_query(url: str, expr: str) -> list:
    with urllib.request.urlopen(url + "/api/v1/query?query=" + urllib.request.quote(expr), timeout=5) as resp:
        return json.loads(resp.read())["data"]["result"]


def wait_series(url: str, expr: str, timeout: float = 30) -> list:
    deadline = time.time() + timeout
    while time.time() < deadline:
        result = prom_query(url, expr)
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"{expr} never appeared in Prometheus")


@pytest.fixture
def stack_dir(tmp_path: Path):
    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    directory = tmp_path / "stack"
    ports = dict(prometheus=free_port(), alertmanager=free_port(), runbook=free_port())
    env = {k: v for k, v in os.environ.items() if k != "RLWATCH_RUNBOOK_URL"}
    result = rlwatch_cli("up", "--dir", str(directory), "--prometheus-port", str(ports["prometheus"]),
                         "--alertmanager-port", str(ports["alertmanager"]), "--runbook-port", str(ports["runbook"]),
                         env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    yield directory, ports
    rlwatch_cli("down", "--dir", str(directory))


def test_up_starts_servers_with_rules_and_down_stops_them(stack_dir):
    directory, ports = stack_dir
    processes = running(directory)
    assert set(processes) >= {"prometheus", "alertmanager"}
    prom = f"http://127.0.0.1:{ports['prometheus']}"
    rules = json.loads(urllib.request.urlopen(prom + "/api/v1/rules", timeout=5).read())["data"]["groups"]
    names = {r["name"] for g in rules for r in g["rules"]}
    assert {"RLWatchKLSpike", "RLWatchKLJump", "RLWatchExporterDown", "RLWatchWatchdog"} <= names
    ready = urllib.request.urlopen(f"http://127.0.0.1:{ports['alertmanager']}/-/ready", timeout=5)
    assert ready.status == 200
    config = (directory / "prometheus.yml").read_text()
    # Targets come from registration only: no fixed port list that would page for ports nobody used.
    import yaml

    jobs = yaml.safe_load(config)["scrape_configs"]
    assert [job["job_name"] for job in jobs] == ["rlwatch-sd"] and "file_sd_configs" in jobs[0]
    assert ":940" not in config
    pids = [info["pid"] for info in processes.values()]
    result = rlwatch_cli("down", "--dir", str(directory))
    assert result.returncode == 0 and "prometheus" in result.stdout
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_registered_exporter_is_scraped_without_a_hand_written_target(stack_dir):
    directory, ports = stack_dir
    prom = f"http://127.0.0.1:{ports['prometheus']}"
    with Watch(run="discovered", port=0, store=None, sd_dir=str(directory / "targets")) as watch:
        watch.observe(0, **make_step())
        files = list((directory / "targets").glob("*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text())[0]["labels"]["run"] == "discovered"
        result = wait_series(prom, 'rlwatch_steps_total{run="discovered",job="rlwatch-sd"}', timeout=40)
        assert float(result[0]["value"][1]) == 1
        up = wait_series(prom, 'up{job="rlwatch-sd",run="discovered"}')
        assert up[0]["value"][1] == "1"
    assert not list((directory / "targets").glob("*.json"))          # unregistered on close


def test_runbook_links_work_after_the_run_ended_and_down_stops_their_server(stack_dir):
    """The rules Prometheus loaded, and the in-process alerts of a Watch registered with the stack, link to
    the stack's runbook server, not to the run's exporter: after the run closed (its exporter refuses
    connections) every alert's link still opens its section."""
    import re
    import urllib.error

    directory, ports = stack_dir
    prom = f"http://127.0.0.1:{ports['prometheus']}"
    base = f"http://127.0.0.1:{ports['runbook']}/"
    with Watch(run="paged-at-night", port=0, store=None, alerts=True, sd_dir=str(directory / "targets")) as watch:
        for step in range(3):                                          # k3 far above its bound: a page
            watch.observe(step, **make_step(seed=step, noise=1.0))
        exporter = watch.url
        paged = [e for e in watch.evaluator.events if e.name == "RLWatchKLSpike"]
    # the in-process page (console, store, webhook/Slack) links to the stack's runbook server too
    assert paged and paged[0].runbook_url == base + "#rlwatchklspike", paged
    with pytest.raises(urllib.error.URLError):                          # the run's own runbook copy is gone
        urllib.request.urlopen(exporter.replace("/metrics", "/runbook"), timeout=5)
    rules = json.loads(urllib.request.urlopen(prom + "/api/v1/rules", timeout=5).read())["data"]["groups"]
    links = {r["name"]: r["annotations"]["runbook_url"] for g in rules for r in g["rules"] if r["type"] == "alerting"}
    from rlwatch.alerts.catalogue import ALERTS

    assert set(links) == {a.name for a in ALERTS} and all(url.startswith(base + "#") for url in links.values())
    with urllib.request.urlopen(base, timeout=5) as resp:              # what a click on any link opens
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/html")
        anchors = set(re.findall(r'id="([^"]+)"', resp.read().decode()))
    assert {url.split("#", 1)[1] for url in links.values()} <= anchors
    server = running(directory)["runbook"]
    assert rlwatch_cli("down", "--dir", str(directory)).returncode == 0
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(server["pid"], 0)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base, timeout=5)


def test_up_names_the_package_when_a_binary_is_missing(tmp_path):
    env = dict(os.environ, PATH=str(Path(sys.executable).parent))     # python only, no servers
    result = rlwatch_cli("up", "--dir", str(tmp_path / "s"), env=env)
    assert result.returncode == 1
    assert "apt-get install" in result.stderr and "prometheus" in result.stderr


def test_ray_actor_exporter_is_discovered(stack_dir):
    """A Ray actor runs the hook; Prometheus finds it through the file_sd directory."""
    ray = need_module("ray")
    directory, ports = stack_dir
    prom = f"http://127.0.0.1:{ports['prometheus']}"
    sd_dir = str(directory / "targets")

    class TrainerActor:
        def __init__(self) -> None:
            import rlwatch

            self.watch = rlwatch.Watch(run="ray-actor", port=0, store=None, sd_dir=sd_dir, framework="ray-test")

        def step(self, i: int) -> int:
            import torch

            mask = torch.ones(4, 8, dtype=torch.bool)
            self.watch.observe(i, mask=mask, sampler_logp=-torch.ones(4, 8), trainer_logp=-torch.ones(4, 8) * 0.9)
            return os.getpid()

        def close(self) -> None:
            self.watch.close()

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    try:
        actor = ray.remote(TrainerActor).remote()
        actor_pid = ray.get(actor.step.remote(0))
        assert actor_pid != os.getpid()
        result = wait_series(prom, 'rlwatch_steps_total{run="ray-actor"}', timeout=60)
        assert result[0]["metric"]["job"] == "rlwatch-sd"
        ray.get(actor.close.remote())
    finally:
        ray.shutdown()


def test_a_second_up_on_taken_ports_fails_naming_what_holds_them(stack_dir, tmp_path):
    directory, ports = stack_dir
    first = running(directory)
    second = tmp_path / "second"
    try:
        result = rlwatch_cli("up", "--dir", str(second), "--prometheus-port", str(ports["prometheus"]),
                             "--alertmanager-port", str(free_port()))
        left = running(second)
    finally:
        rlwatch_cli("down", "--dir", str(second))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip() == (
        f"rlwatch up: port {ports['prometheus']} on 127.0.0.1 is taken by the prometheus of the rlwatch stack in "
        f"{directory} (pid {first['prometheus']['pid']}): stop it with `rlwatch down --dir {directory}` or choose "
        f"other ports")
    assert left == {} and running(directory) == first                  # nothing of its own left, the first intact


def test_readiness_counts_only_the_started_server_answering(stack_dir, tmp_path):
    """The first stack answers /-/ready on the port while the new server (here a `sleep 1` that never
    listens) is still starting: that answer is not the new server's, and its exit names the port's holder."""
    from rlwatch.runs.stack import StackError, _wait_ready

    directory, ports = stack_dir
    impostor = subprocess.Popen(["sleep", "1"])
    try:
        with pytest.raises(StackError, match=f"port {ports['prometheus']} on 127.0.0.1 is taken by the prometheus "
                                             f"of the rlwatch stack in {directory}"):
            _wait_ready(f"http://127.0.0.1:{ports['prometheus']}/-/ready", impostor, tmp_path / "log", "127.0.0.1",
                        ports["prometheus"], timeout=20)
    finally:
        impostor.kill()
        impostor.wait(timeout=10)


NEWCOMER = """
import sys, time
from rlwatch import Watch
from tests.conftest import make_step
with Watch(run=sys.argv[1], port=0, store=None) as watch:
    for step in range(3):                # k3 ~0.65 nats, far above kl_k3_max: RLWatchKLSpike opens
        watch.observe(step, **make_step(seed=step, noise=1.0))
    print(watch.port, flush=True)
    sys.stdin.readline()                 # until the test has seen it in Prometheus
"""


def test_newcomer_flow_a_run_registers_with_the_stack_up_started(tmp_path):
    """`rlwatch up`, then a run in another shell with no RLWATCH_* variable: Prometheus scrapes it (its
    target is up, its series and its critical alert are there); with RLWATCH_SD_DIR= it stays out; then
    `rlwatch down`."""
    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLWATCH_")}
    clean.update(XDG_STATE_HOME=str(tmp_path / "state"), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    port = free_port()
    prom = f"http://127.0.0.1:{port}"
    up = subprocess.run([sys.executable, "-m", "rlwatch", "up", "--prometheus-port", str(port),
                         "--alertmanager-port", str(free_port()), "--runbook-port", str(free_port())],
                        capture_output=True, text=True, timeout=90,
                        env=clean, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    runs = []
    try:
        for name, extra in (("newcomer", {}), ("opted-out", {"RLWATCH_SD_DIR": ""})):
            runs.append(subprocess.Popen([sys.executable, "-c", NEWCOMER, name], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         env={**clean, **extra}, cwd=tmp_path))
            assert runs[-1].stdout.readline().strip().isdigit()
        targets = tmp_path / ".rlwatch-stack" / "targets"
        assert sorted(group["labels"]["run"] for p in targets.glob("*.json")
                      for group in json.loads(p.read_text())) == ["newcomer"]
        assert wait_series(prom, 'up{run="newcomer"} == 1', timeout=40)[0]["metric"]["job"] == "rlwatch-sd"
        assert float(wait_series(prom, 'rlwatch_steps_total{run="newcomer"}')[0]["value"][1]) == 3
        firing = 'ALERTS{alertname="RLWatchKLSpike",alertstate="firing",run="newcomer",severity="critical"}'
        assert wait_series(prom, firing, timeout=40)                       # its alert, from the stack's rules
        for run in runs:
            assert run.communicate("\n", timeout=60) and run.returncode == 0
        assert not list(targets.glob("*.json"))                          # unregistered on close
    finally:
        for run in runs:
            run.kill()
        down = subprocess.run([sys.executable, "-m", "rlwatch", "down"], capture_output=True, text=True,
                              timeout=90, env=clean, cwd=tmp_path)
    assert down.returncode == 0 and "prometheus" in down.stdout, down.stdout + down.stderr


def test_a_watch_registers_nowhere_when_the_listed_stack_stopped(tmp_path, monkeypatch):
    """A stack that died without `rlwatch down` is still listed: a Watch does not register with it (and
    the listing goes)."""
    directory = tmp_path / "stack"
    (directory / "targets").mkdir(parents=True)
    (directory / "pids.json").write_text(json.dumps({"prometheus": {"pid": 2 ** 22 + 1, "exe": "/usr/bin/prometheus",
                                                                    "start": "1"}}))
    monkeypatch.setenv("RLWATCH_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "state" / "stacks").mkdir(parents=True)
    (tmp_path / "state" / "stacks" / "gone.json").write_text(json.dumps({"directory": str(directory)}))
    with Watch(run="alone", port=0, store=None, alerts=False) as watch:
        assert watch.port and watch.registration is None
    assert not list((directory / "targets").iterdir()) and not list((tmp_path / "state" / "stacks").iterdir())
