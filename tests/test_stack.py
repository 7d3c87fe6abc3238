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
from rlwatch.stack import running

from .conftest import free_port, make_step, need_binary, need_module

pytestmark = pytest.mark.servers


def rlwatch_cli(*args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlwatch.cli", *args], capture_output=True, text=True,
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
    ports = dict(prometheus=free_port(), alertmanager=free_port())
    result = rlwatch_cli("up", "--dir", str(directory), "--prometheus-port", str(ports["prometheus"]),
                         "--alertmanager-port", str(ports["alertmanager"]))
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
