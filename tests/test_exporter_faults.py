"""The /metrics endpoint against hostile clients and process faults: clients trickling their request
heads, thousands of distinct Accept headers, unknown paths; a trainer that forks (DataLoader workers);
and what a clean exit leaves for a real Prometheus (no RLWatchExporterDown, not even pending)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import rlwatch
from rlwatch.alerts import render

from tests.conftest import ROOT, free_port, make_step, need_binary, start_process


def scrape_status(port: int, timeout: float = 5.0) -> tuple[int, float]:
    """(HTTP status, seconds) of one /metrics scrape."""
    start = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        resp.read()
        return resp.status, time.monotonic() - start


SERVER = """
import select, sys
import rlwatch
from tests.conftest import make_step
watch = rlwatch.Watch(run="hostile", port=0, store=None, alerts=False)
watch.observe(0, **make_step())
print(watch.port, flush=True)
step = 1
while not select.select([sys.stdin], [], [], 0.5)[0]:    # until the test closes stdin
    watch.observe(step, **make_step(seed=step % 8))        # a new step every 0.5 s: the cache re-renders
    step += 1
watch.close()
"""


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("VmRSS:")))


def _request(port: int, path: str, accept: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


class Tricklers:
    """``count`` clients, each on its own thread, sending a request head one byte every ``pause``
    seconds and never finishing it; a client the server drops connects again at once."""

    HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10000

    def __init__(self, port: int, count: int = 64, pause: float = 2.0) -> None:
        self.port, self.pause, self.running = port, pause, True
        self.connected, self.dropped = set(), 0
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        while self.running:
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            except OSError:
                time.sleep(0.1)
                continue
            self.connected.add(index)
            try:
                for byte in self.HEAD:
                    sock.send(bytes([byte]))
                    time.sleep(self.pause)
                    if not self.running:
                        break
            except OSError:
                self.dropped += 1
            finally:
                sock.close()

    def stop(self) -> None:
        self.running = False
        for thread in self.threads:
            thread.join(timeout=self.pause + 5)


@pytest.mark.slow           # about 20 s: out of `make check`, run by `make test` and CI
def test_trickling_clients_and_distinct_accept_headers_never_keep_scrapes_out():
    """64 clients trickle their heads a byte every 2 s (reconnecting when dropped) while 3,000
    requests with distinct Accept headers (quoted and unquoted parameters, q-values, unknown versions)
    and unknown paths arrive: a scrape every 0.25 s is answered within 2 s throughout, nothing answers
    500, and the server process grows by less than 30 MB."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    tricklers = None
    try:
        port = int(server.stdout.readline())
        for accept in ("text/plain", "application/openmetrics-text; version=1.0.0") * 20:
            _request(port, "/metrics", accept)
        before = _rss_kib(server.pid)
        tricklers = Tricklers(port)
        deadline = time.monotonic() + 30
        while len(tricklers.connected) < 64 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(tricklers.connected) == 64
        statuses: dict[int, int] = {}

        def spray() -> None:
            for i in range(3000):
                accept = (f'application/openmetrics-text; version="1.0.{i}"; q=0.{i % 10}, text/plain; q="0.5"'
                          if i % 2 else f"text/plain; version=0.0.{i}; x-{i}=\"a,b;c\", */*;q=0.1")
                path = f"/unknown/{i}" if i % 10 == 0 else "/metrics"
                status = _request(port, path, accept)
                statuses[status] = statuses.get(status, 0) + 1

        sprayer = threading.Thread(target=spray, daemon=True)
        sprayer.start()
        latencies = []
        start = time.monotonic()
        while sprayer.is_alive() or time.monotonic() - start < 20:
            status, seconds = scrape_status(port, timeout=10)
            assert status == 200
            latencies.append(seconds)
            time.sleep(0.25)
        tricklers.stop()
        sprayer.join()
        growth_mib = (_rss_kib(server.pid) - before) / 1024
        print(f"\nhostile clients: {len(latencies)} scrapes over {time.monotonic() - start:.0f} s, max "
              f"{max(latencies):.3f} s, median {sorted(latencies)[len(latencies) // 2]:.3f} s; {tricklers.dropped} "
              f"trickling clients dropped; answers {statuses}; server RSS {before / 1024:.1f} MiB, "
              f"+{growth_mib:.1f} MiB")
        assert max(latencies) < 2.0
        assert statuses == {200: 2700, 404: 300}
        assert tricklers.dropped >= 64                     # each was cut at its head deadline, not kept
        assert growth_mib < 30
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "rlwatch_steps_total" in exposition and 'stage="export"' not in exposition   # no hook error
    finally:
        if tricklers is not None:
            tricklers.stop()
        server.stdin.close()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()


FAST_TRICKLERS = """
import asyncio, sys, time
port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
HEAD = b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\nX-Slow: " + b"a" * 100000

async def client(end):
    while time.monotonic() < end:                  # a client the server drops connects again at once
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        try:
            for byte in HEAD:                      # a byte every millisecond, never the blank line
                if time.monotonic() > end or reader.at_eof():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.001)
        except OSError:
            pass
        writer.close()

async def main():
    end = time.monotonic() + seconds
    await asyncio.gather(*(client(end) for _ in range(count)))

print("ready", flush=True)
asyncio.run(main())
"""


@pytest.mark.slow           # about 15 s: out of `make check`, run by `make test` and CI
def test_fast_trickling_clients_never_make_scrapes_time_out():
    """64 clients trickle their heads as fast as they can, a byte a millisecond, for 12 s: every
    scrape (5 s timeout, Prometheus's default scrape_timeout is 10 s) is answered, and reading their
    heads never pauses accepting (the server answers within a second throughout)."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    tricklers = None
    try:
        port = int(server.stdout.readline())
        tricklers = subprocess.Popen([sys.executable, "-c", FAST_TRICKLERS, str(port), "64", "12"],
                                     stdout=subprocess.PIPE, text=True)
        assert tricklers.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        latencies, failures = [], []
        while tricklers.poll() is None:
            try:
                latencies.append(scrape_status(port, timeout=5)[1])
            except OSError as exc:
                failures.append(repr(exc))
            time.sleep(0.25)
        print(f"\nfast tricklers: {len(latencies)} scrapes answered, {len(failures)} failed, "
              f"max {max(latencies, default=0):.3f} s")
        assert failures == [] and len(latencies) >= 10
        assert max(latencies) < 1.0
    finally:
        for proc in (tricklers, server):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


# --- a forked child ----------------------------------------------------------------------------------

def test_a_forked_child_does_not_keep_the_port():
    """A child forked while the Watch serves (a DataLoader worker) closes its copy of the listening
    socket: once the parent closes its Watch, scrapes are refused at once (not left hanging in a
    backlog nobody accepts), and a new Watch binds the port while the child still lives."""
    watch = rlwatch.Watch(run="forked", port=0, store=None, alerts=False)
    watch.observe(0, **make_step())
    port = watch.port
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:                                        # the child: wait until told, touch nothing
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    try:
        assert scrape_status(port)[0] == 200              # the parent still serves
        watch.close()
        start = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=3).close()
        assert time.monotonic() - start < 1
        with rlwatch.Watch(run="again", port=port, store=None, alerts=False, strict=True) as again:
            again.observe(0, **make_step())
            assert again.port == port and scrape_status(port)[0] == 200
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)       # the child was alive throughout
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)
        watch.close()


# --- a clean exit seen by a real Prometheus ------------------------------------------------------------

@pytest.fixture
def prometheus(tmp_path: Path, request):
    """Prometheus with the shipped rules as they are, scraping every 1 s the exporters that register
    in a file_sd directory."""
    binary = need_binary("prometheus")
    port = free_port()
    (tmp_path / "rules.yaml").write_text(render.rules_yaml())
    sd_dir = tmp_path / "targets"
    sd_dir.mkdir()
    (tmp_path / "prometheus.yml").write_text(render.to_yaml({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [{"job_name": "rlwatch-sd", "honor_labels": True,
                            "file_sd_configs": [{"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}]}],
    }))
    server = start_process([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                            f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                           port, tmp_path / "prometheus.log")
    request.addfinalizer(server.stop)
    server.sd_dir = sd_dir
    return server


def _get(prometheus, path: str) -> dict:
    return json.loads(urllib.request.urlopen(prometheus.url + path, timeout=5).read())["data"]


def test_a_clean_exit_never_makes_exporter_down_pending(prometheus):
    """A run that closes cleanly: Prometheus scraped it (in OpenMetrics, without a parse error), it
    unregisters and stops serving; for the next 20 s (Prometheus needs up to ~6 s to drop a target
    whose file was removed, and may scrape it meanwhile) RLWatchExporterDown is neither pending nor
    firing."""
    watch = rlwatch.Watch(run="clean", port=0, store=None, alerts=False, sd_dir=str(prometheus.sd_dir))
    watch.observe(0, **make_step())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        targets = _get(prometheus, "/api/v1/targets")["activeTargets"]
        if targets and targets[0]["health"] == "up":
            break
        time.sleep(0.2)
    assert targets and targets[0]["health"] == "up", targets
    assert targets[0]["lastError"] == ""
    time.sleep(3)                                          # a few successful scrapes
    watch.close()
    seen = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        seen += [a["state"] for a in _get(prometheus, "/api/v1/alerts")["alerts"]
                 if a["labels"]["alertname"] == "RLWatchExporterDown"]
        time.sleep(0.25)
    assert seen == [], seen
    assert _get(prometheus, "/api/v1/targets")["activeTargets"] == []
