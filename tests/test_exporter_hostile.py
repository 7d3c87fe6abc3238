"""The /metrics server against the clients and process limits that beat a hand-written server:
clients that never read their answer, huge Accept headers, a process out of threads, a process out
of file descriptors, HTTP/0.9 and absolute-form request lines. The side-by-side figures against
prometheus_client's own server are in bench/bench_server.py."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import rlwatch

from tests.conftest import ROOT, make_step


def _scrape(port: int, path: str = "/metrics", timeout: float = 3.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return resp.status, resp.read()


def _raw(port: int, request: bytes, timeout: float = 3.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_clients_that_never_read_cost_their_own_connection_only():
    """8 clients ask for a 4 MB answer (more than loopback's send buffers hold) with a tiny receive
    window and never read: every ordinary scrape meanwhile is answered at once."""
    from rlwatch.exporters.http import MetricsServer

    big = b"x" * (4 << 20)

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/big":
            start_response("200 OK", [("Content-Length", str(len(big)))])
            return [big]
        start_response("200 OK", [("Content-Length", "3")])
        return [b"ok\n"]

    server = MetricsServer(None, "127.0.0.1", 0, app=app)
    hostile = []
    try:
        for _ in range(8):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            hostile.append(sock)
        time.sleep(0.3)                                  # their answers are stuck in the server
        slowest = 0.0
        for _ in range(10):
            start = time.monotonic()
            assert _scrape(server.port, "/metrics", timeout=3) == (200, b"ok\n")
            slowest = max(slowest, time.monotonic() - start)
        assert slowest < 1.0, slowest
    finally:
        for sock in hostile:
            sock.close()
        server.close()


def test_a_huge_accept_header_is_read_only_up_to_its_bound():
    """A 15 KB Accept header (read holding the GIL, so the trainer waits meanwhile) costs no more than its
    first MAX_ACCEPT_CHARS characters and MAX_ACCEPT_RANGES ranges: the negotiation reads that prefix only
    and decides as it would on it (bench/bench_server.py times the trainer under such scrapers)."""
    from rlwatch.exporters.prometheus import MAX_ACCEPT_CHARS, MAX_ACCEPT_RANGES, _accepts_gzip, negotiate

    class Spy(str):
        reads: list = []

        def __getitem__(self, key):
            Spy.reads.append(key)
            return str.__getitem__(self, key)

    for header in (("a/b;x=1," * 2000)[:15000], ('text/plain;x="a,b;c\\"d";q=0.3,' * 600)[:15000],
                   "text/plain;q=0.5," * 1000 + "application/openmetrics-text;version=1.0.0"):
        for decide in (negotiate, _accepts_gzip):
            Spy.reads = []
            got = decide(Spy(header))
            assert Spy.reads == [slice(None, MAX_ACCEPT_CHARS, None)], Spy.reads      # one read, of the prefix
            prefix = header[:MAX_ACCEPT_CHARS]
            assert got == decide(prefix[:prefix.rfind(",")]), decide.__name__            # the cut range not read
    assert negotiate("text/plain;q=0.5," * 1000 + "application/openmetrics-text;version=1.0.0") == "text"
    ranges = ",".join(["text/plain;q=0.1"] * MAX_ACCEPT_RANGES + ["application/openmetrics-text"])
    assert len(ranges) < MAX_ACCEPT_CHARS and negotiate(ranges) == "text"              # range 65 not read


def test_a_process_out_of_threads_still_serves_quietly_and_closes_promptly(capfd, monkeypatch):
    """No thread can be started (a cgroup's PID limit): scrapes are still answered, nothing is
    printed to the trainer's stderr, close() returns at once; a Watch started in that state runs
    without its endpoint, the failure counted."""
    watch = rlwatch.Watch(run="nothreads", port=0, store=None, alerts=False)
    watch.observe(0, **make_step())

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    try:
        for _ in range(5):
            assert _scrape(watch.port, timeout=2)[0] == 200
        start = time.monotonic()
        watch.close()
        assert time.monotonic() - start < 2
        with rlwatch.Watch(run="nothreads2", port=0, store=None, alerts=False) as starved:
            starved.observe(0, **make_step())
            assert starved.server is None and starved.errors.counts[("export", "port")] == 1
    finally:
        monkeypatch.undo()
        watch.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


FLOOD = textwrap.dedent("""
    import socket, sys, threading
    port, running = int(sys.argv[1]), [True]
    def scrape():
        while running[0]:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(b"GET /metrics HTTP/1.0\\r\\n\\r\\n")
                    while sock.recv(65536):
                        pass
            except OSError:
                pass
    for _ in range(8):
        threading.Thread(target=scrape, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()
    running[0] = False
""")


def test_a_flood_of_scrapers_takes_a_bounded_share_of_the_trainers_process():
    """8 clients scrape back to back (each answer costs 2 ms of Python): the server's CPU in the
    trainer's process (and so its share of the GIL) stays near its 10 % of a core, and scrapes are
    served."""
    from rlwatch.exporters.http import MetricsServer

    def app(environ, start_response):
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        start_response("200 OK", [("Content-Length", "3")])
        return [b"ok\n"]

    server = MetricsServer(None, "127.0.0.1", 0, app=app)
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(server.port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(2.0)
        share = (time.process_time() - cpu) / (time.monotonic() - wall)
        print(f"server share {share:.3f}")
        assert share < 0.3, share
        assert _scrape(server.port, timeout=5) == (200, b"ok\n")
    finally:
        flood.kill()
        flood.wait()
        server.close()


OUT_OF_DESCRIPTORS = textwrap.dedent("""
    import os, resource, sys, time
    import rlwatch
    from tests.conftest import make_step
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    watch = rlwatch.Watch(run="nofd", port=0, store=None, alerts=False)
    watch.observe(0, **make_step())
    print(watch.port, flush=True)
    sys.stdin.readline()
    fillers = []
    try:
        while True:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print("full", flush=True)
    sys.stdin.readline()                       # the clients are waiting now
    start_cpu, start = time.process_time(), time.monotonic()
    time.sleep(1.5)
    cpu = time.process_time() - start_cpu
    for fd in fillers:
        os.close(fd)
    print(f"{cpu:.3f} {time.monotonic() - start:.3f} {watch.errors.counts.get(('export', 'server'), 0)}",
          flush=True)
    sys.stdin.readline()
    watch.close()
""")


def test_out_of_file_descriptors_the_server_waits_instead_of_spinning_and_recovers():
    """The trainer's process has no descriptor left while clients connect: the server burns
    (nearly) no CPU meanwhile, counts the failure, and serves again once descriptors are free."""
    child = subprocess.Popen([sys.executable, "-c", OUT_OF_DESCRIPTORS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    clients = []
    try:
        port = int(child.stdout.readline())
        child.stdin.write("fill\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "full"
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)   # waits in the backlog
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            clients.append(sock)
        child.stdin.write("measure\n")
        child.stdin.flush()
        cpu, seconds, counted = child.stdout.readline().split()
        assert float(cpu) < 0.25 * float(seconds), (cpu, seconds)
        assert int(counted) >= 1
        for sock in clients:                                   # served once descriptors are back
            sock.settimeout(5)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.0 200") and b"rlwatch_steps_total" in answer
        assert _scrape(port, timeout=5)[0] == 200
        child.stdin.write("close\n")
        child.stdin.flush()
        assert child.wait(timeout=20) == 0
    finally:
        for sock in clients:
            sock.close()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_http_0_9_and_absolute_form_requests_are_answered_at_once():
    """``GET /metrics`` with no version (HTTP/0.9: no headers follow) is answered without waiting
    for a blank line; ``GET http://host:port/metrics HTTP/1.1`` (absolute form) is the same page."""
    with rlwatch.Watch(run="forms", port=0, store=None, alerts=False) as watch:
        watch.observe(0, **make_step())
        start = time.monotonic()
        answer = _raw(watch.port, b"GET /metrics\r\n")
        assert time.monotonic() - start < 1.0
        assert answer.startswith(b"# HELP") and b"rlwatch_steps_total" in answer     # HTTP/0.9: the body only
        answer = _raw(watch.port, f"GET http://127.0.0.1:{watch.port}/metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n"
                      .encode())
        assert answer.startswith(b"HTTP/1.0 200") and b"rlwatch_steps_total" in answer
        assert _raw(watch.port, b"GET http://127.0.0.1/nothing HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 404")
        assert b"400" in _raw(watch.port, b"BREW /metrics\r\n")               # HTTP/0.9 knows GET only


def test_a_malformed_request_target_is_the_clients_error_never_the_hooks(caplog):
    """``GET http://[::1/metrics`` (an IPv6 host never closed) and other malformed targets, with and
    without basic_auth: answered 400 and counted in rlwatch_http_client_errors_total{code="400"};
    rlwatch_hook_errors_total (which pages RLWatchHookErrors) and the trainer's log stay quiet."""
    targets = [b"http://[::1/metrics", b"http://[zz]/metrics", b"https://[/"]
    for auth in (None, ("prom", "secret")):
        with rlwatch.Watch(run="badtarget", port=0, store=None, alerts=False, basic_auth=auth) as watch:
            watch.observe(0, **make_step())
            caplog.clear()
            for target in targets:
                answer = _raw(watch.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                assert answer.startswith(b"HTTP/1.0 400"), (target, answer[:80])
            assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
            token = base64.b64encode(b"prom:secret").decode()
            request = urllib.request.Request(f"http://127.0.0.1:{watch.port}/metrics",
                                             headers={"Authorization": f"Basic {token}"} if auth else {})
            exposition = urllib.request.urlopen(request, timeout=5).read().decode()
            assert 'stage="export"' not in exposition
            errors = [line for line in exposition.splitlines() if line.startswith("rlwatch_http_client_errors_total")]
            assert len(errors) == 1 and 'code="400"' in errors[0] and errors[0].endswith(f" {len(targets)}.0"), errors


BIG_ANSWER = textwrap.dedent("""
    import sys
    from rlwatch.exporters.http import MetricsServer
    big = b"x" * (4 << 20)                     # one cached 4 MB answer, as the exposition cache holds it
    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", str(len(big)))])
        return [big]
    server = MetricsServer(None, "127.0.0.1", 0, app=app, timeout=30.0)
    print(server.port, flush=True)
    sys.stdin.readline()
    server.close()
""")


def test_never_reading_clients_on_a_large_answer_hold_bounded_memory():
    """Three rounds of 32 clients asking for a 4 MB answer with a 1 KB receive window and never
    reading: the server's process grows by far less than one copy of the answer per client (the
    answer is handed to each connection a slice at a time as it drains)."""
    server = subprocess.Popen([sys.executable, "-c", BIG_ANSWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    hostile: list[socket.socket] = []
    try:
        port = int(server.stdout.readline())

        def rss_mib() -> float:
            with open(f"/proc/{server.pid}/status") as status:
                return int(next(line.split()[1] for line in status if line.startswith("VmRSS:"))) / 1024

        before, peak = rss_mib(), 0.0
        for _ in range(3):
            for _ in range(32):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                sock.connect(("127.0.0.1", port))
                sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
                hostile.append(sock)
            time.sleep(1.0)
            peak = max(peak, rss_mib())
        status, body = _scrape(port, "/metrics", timeout=5)
        print(f"\nRSS {before:.0f} MiB -> peak {peak:.0f} MiB with {len(hostile)} never-reading clients")
        assert status == 200 and len(body) == 4 << 20
        assert peak - before < 32, (before, peak)          # one copy per client would be 384 MiB
    finally:
        for sock in hostile:
            sock.close()
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, 9)
            server.wait()
