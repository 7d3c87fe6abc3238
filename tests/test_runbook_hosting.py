"""Where the rules' runbook links point: the stack's own runbook server by default, a team's copy
when a runbook URL is configured at `rlwatch up` or render time; and the stack's runbook server
against idle clients (a real server process on 127.0.0.1)."""

from __future__ import annotations

import re

import pytest

from rlwatch.runs import resources
from rlwatch.alerts import render
from rlwatch.alerts.catalogue import ALERTS
from rlwatch.runs.stack import RUNBOOK_PORT, StackConfig, write_configs


def test_the_stack_links_its_rules_to_its_own_runbook_server(tmp_path, monkeypatch):
    monkeypatch.delenv("RLWATCH_RUNBOOK_URL", raising=False)
    cfg = StackConfig(tmp_path / "stack", runbook_port=19097)
    assert cfg.serves_runbook and StackConfig(tmp_path / "d").runbook_port == RUNBOOK_PORT
    write_configs(cfg)
    rules = (cfg.directory / render.RULES_FILE).read_text()
    links = re.findall(r'runbook_url: "([^"]+)"', rules)
    assert len(links) == len(ALERTS) and all(link.startswith("http://127.0.0.1:19097/#") for link in links)
    site = (cfg.runbook_site / "index.html").read_text()              # what the server serves at /
    assert site == resources.runbook_html()
    assert all(f'id="{link.split("#", 1)[1]}"' in site for link in links)
    assert (cfg.runbook_site / render.RUNBOOK_FILE).read_text() == render.runbook_md()


def test_a_team_hosted_copy_replaces_the_stack_runbook_server(tmp_path, monkeypatch):
    monkeypatch.delenv("RLWATCH_RUNBOOK_URL", raising=False)
    team = StackConfig(tmp_path / "opt", runbook_url="https://wiki.example/rl/runbook")       # --runbook-url
    assert not team.serves_runbook
    write_configs(team)
    assert "https://wiki.example/rl/runbook#rlwatchklspike" in (team.directory / render.RULES_FILE).read_text()
    monkeypatch.setenv("RLWATCH_RUNBOOK_URL", "https://team.example/rb")                      # the variable
    env = StackConfig(tmp_path / "env")
    assert not env.serves_runbook and env.runbook_base() == "https://team.example/rb"
    # at render time, for rules a team deploys itself
    assert render.main(["--dir", str(tmp_path / "mine"), "--runbook-url", "https://wiki.example/x"]) == 0
    assert "https://wiki.example/x#rlwatchklspike" in (tmp_path / "mine" / render.RULES_FILE).read_text()


@pytest.mark.slow        # about 10-20 s: in `make test`, out of the fast loop (`make check`)
def test_the_runbook_server_cuts_idle_connections_and_bounds_its_threads(tmp_path):
    """200 connections that never send a byte to `rlwatch up`'s runbook server: it holds at most
    MAX_THREADS threads for them, cuts each after its idle timeout, and then serves the runbook."""
    import os
    import signal
    import socket
    import subprocess
    import time
    import urllib.request

    from rlwatch.runs.runbook_server import IDLE_TIMEOUT_S, MAX_THREADS
    from rlwatch.runs.stack import runbook_command

    from tests.conftest import ROOT, free_port, wait_http

    cfg = StackConfig(tmp_path / "stack", runbook_port=free_port())
    write_configs(cfg)
    server = subprocess.Popen(runbook_command(cfg), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    idle: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{cfg.runbook_port}/index.html"
        wait_http(url, proc=server)
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", cfg.runbook_port), timeout=5))
        time.sleep(1.0)
        with open(f"/proc/{server.pid}/status") as status:
            threads = int(next(line.split()[1] for line in status if line.startswith("Threads:")))
        assert threads <= MAX_THREADS + 2, threads
        time.sleep(IDLE_TIMEOUT_S + 2)
        cut = 0
        for sock in idle:
            sock.settimeout(2)
            try:
                cut += sock.recv(1024) in (b"", b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                                 b"Connection: close\r\n\r\n")
            except (TimeoutError, OSError):
                pass
        assert cut == len(idle)
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200 and b"RLWatch" in resp.read()
    finally:
        for sock in idle:
            sock.close()
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
