"""The exporter's server against prometheus_client's own server, side by side, in one run.

Each scenario runs against rlwatch's server (``rlwatch.exporters.http.MetricsServer``, as a Watch
starts it) and against prometheus_client's ``start_http_server`` (its ThreadingWSGIServer) serving
the same registry, in the same process, one after the other:

- never-reading clients: 8 clients ask for the largest page with a 1 KB receive window and never
  read, while a scraper asks for /metrics every 50 ms (timeout 5 s): scrapes served, failed, p99.
  Run on the real pages (rlwatch's /runbook, 54 KB) and on a 4 MB answer (the same WSGI app on
  both servers: more than loopback's send buffers hold, so the writes really block).
- huge Accept headers: the trainer (this process's main thread) calls ``observe`` back to back
  while 8 clients in another process scrape /metrics as fast as they can, once with ordinary
  headers and once with 15 KB Accept headers: observe p99 and the ratio between the two.
- no thread can start (``threading.Thread.start`` raises, as under a cgroup's PID limit):
  scrapes served out of 5, tracebacks printed to stderr, seconds ``close()`` takes.
- out of file descriptors (a child process with RLIMIT_NOFILE 256, every descriptor taken, 3
  clients waiting): the server's CPU seconds over 2 s, and whether the clients are served once
  descriptors are back.
- an HTTP/0.9 request line (``GET /metrics``) and an absolute-form one (``GET http://host/metrics``).

    python bench/bench_server.py [--seconds 4]
"""

from __future__ import annotations

import argparse
import io
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from contextlib import redirect_stderr
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rlwatch  # noqa: E402
from rlwatch.exporters.http import MetricsServer  # noqa: E402
from tests.conftest import make_step  # noqa: E402

SERVERS = ("rlwatch", "prometheus_client")
HUGE_ACCEPT = ('text/plain;x="a,b;c\\"d";q=0.3,' * 600)[:15000]
BIG = b"x" * (4 << 20)


def serve(kind: str, app: Callable) -> tuple[int, Callable[[], None]]:
    """(port, stop) of ``app`` served by rlwatch's server or by prometheus_client's (what
    ``start_http_server`` builds: ThreadingWSGIServer with its silent handler)."""
    if kind == "rlwatch":
        server = MetricsServer(None, "127.0.0.1", 0, app=app)
        return server.port, server.close
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

    httpd = make_server("127.0.0.1", 0, app, ThreadingWSGIServer, handler_class=_SilentHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()

    return httpd.server_port, stop


def serve_registry(kind: str, watch: rlwatch.Watch) -> tuple[int, Callable[[], None]]:
    """(port, stop) of the Watch's own endpoint, or of ``start_http_server`` on the Watch's registry."""
    if kind == "rlwatch":
        return watch.port, lambda: None
    from prometheus_client import start_http_server

    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=watch.registry)

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()

    return httpd.server_port, stop


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def never_reading(port: int, path: str, seconds: float) -> dict:
    """8 never-reading clients on ``path``; a scraper on /metrics every 50 ms meanwhile."""
    hostile = []
    for _ in range(8):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        hostile.append(sock)
    time.sleep(0.3)
    ok, failed, latencies = 0, 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            ok += 1
        except OSError:
            failed += 1
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    for sock in hostile:
        sock.close()
    return {"ok": ok, "failed": failed, "p99": percentile(latencies, 0.99), "max": max(latencies)}


SCRAPERS = textwrap.dedent("""
    import socket, sys, threading
    port, accept = int(sys.argv[1]), sys.argv[2]
    request = f"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\nAccept: {accept}\\r\\nConnection: close\\r\\n\\r\\n".encode()
    done, running = [0], [True]
    def scrape():
        while running[0]:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(request)
                    while sock.recv(65536):
                        pass
                done[0] += 1
            except OSError:
                pass
    threads = [threading.Thread(target=scrape, daemon=True) for _ in range(int(sys.argv[3]))]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    running[0] = False
    print(done[0], flush=True)
""")


def trainer_under_scrapers(watch: rlwatch.Watch, port: int, accept: str, seconds: float) -> dict:
    """observe p99 (ms) and steps while 8 scrapers (another process) hammer ``port`` (none: port 0)."""
    steps = [make_step(B=16, T=64, seed=i) for i in range(8)]
    clients = subprocess.Popen([sys.executable, "-c", SCRAPERS, str(port), accept, str(8 if port else 0)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert clients.stdout.readline().strip() == "ready"
        durations = []
        end = time.monotonic() + seconds
        step = watch.state.snapshot().step or 0
        while time.monotonic() < end:
            step += 1
            start = time.perf_counter()
            watch.observe(step, **steps[step % len(steps)])
            durations.append(time.perf_counter() - start)
        clients.stdin.write("stop\n")
        clients.stdin.flush()
        scrapes = int(clients.stdout.readline())
    finally:
        clients.kill()
        clients.wait()
    return {"p99_ms": 1000 * percentile(durations, 0.99), "steps": len(durations), "scrapes": scrapes}


def without_threads(kind: str, app: Callable) -> dict:
    """Scrapes served out of 5 while no thread can start; tracebacks printed; close() seconds."""
    port, stop = serve(kind, app)
    original = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    printed = io.StringIO()
    served = 0
    with redirect_stderr(printed):
        threading.Thread.start = refuse
        try:
            for _ in range(5):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                    served += 1
                except OSError:
                    pass
        finally:
            threading.Thread.start = original
        time.sleep(0.2)
        start = time.monotonic()
        stop()
        closing = time.monotonic() - start
    return {"served": served, "tracebacks": printed.getvalue().count("Traceback"), "close_s": closing}


NO_DESCRIPTORS = textwrap.dedent("""
    import os, resource, sys, threading, time
    sys.path.insert(0, sys.argv[2])
    from bench.bench_server import serve
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "3")])
        return [b"ok\\n"]
    port, stop = serve(sys.argv[1], app)
    print(port, flush=True)
    sys.stdin.readline()
    fillers = []
    try:
        while True:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print("full", flush=True)
    sys.stdin.readline()
    cpu = time.process_time()
    time.sleep(2.0)
    cpu = time.process_time() - cpu
    for fd in fillers:
        os.close(fd)
    print(f"{cpu:.3f}", flush=True)
    sys.stdin.readline()
""")


def out_of_descriptors(kind: str) -> dict:
    """CPU seconds the server burns in 2 s with no descriptor left and 3 clients waiting; whether
    the 3 are served once descriptors are back."""
    child = subprocess.Popen([sys.executable, "-c", NO_DESCRIPTORS, kind, str(ROOT)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    clients = []
    try:
        port = int(child.stdout.readline())
        child.stdin.write("fill\n")
        child.stdin.flush()
        child.stdout.readline()
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            clients.append(sock)
        child.stdin.write("measure\n")
        child.stdin.flush()
        cpu = float(child.stdout.readline())
        served = 0
        for sock in clients:
            try:
                served += sock.recv(100).startswith(b"HTTP/1.0 200")
            except OSError:
                pass
        return {"cpu_s_in_2s": cpu, "served_after": served}
    finally:
        for sock in clients:
            sock.close()
        child.kill()
        child.wait()


def request_forms(port: int) -> dict:
    """Seconds to an answer for ``GET /metrics`` (HTTP/0.9, waited for 6 s at most); status of an
    absolute-form request."""
    def exchange(request: bytes) -> tuple[bytes, float]:
        start = time.monotonic()
        data = b""
        with socket.create_connection(("127.0.0.1", port), timeout=6) as sock:
            sock.sendall(request)
            try:
                while chunk := sock.recv(65536):
                    data += chunk
            except TimeoutError:
                return b"", float("inf")
        return data, time.monotonic() - start

    answer, seconds = exchange(b"GET /metrics\r\n")
    absolute, _ = exchange(f"GET http://127.0.0.1:{port}/metrics HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return {"http09_s": seconds, "http09_served": b"rlwatch_steps" in answer,
            "absolute_status": absolute.split(b" ", 2)[1].decode() if absolute else "-"}


def big_app(environ: dict, start_response: Callable) -> list[bytes]:
    if environ["PATH_INFO"] == "/big":
        start_response("200 OK", [("Content-Length", str(len(BIG)))])
        return [BIG]
    start_response("200 OK", [("Content-Length", "3")])
    return [b"ok\n"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each timed phase")
    args = parser.parse_args()
    rows: dict[str, dict[str, dict]] = {kind: {} for kind in SERVERS}
    with rlwatch.Watch(run="bench", port=0, store=None, alerts=False) as watch:
        watch.observe(0, **make_step())
        idle = trainer_under_scrapers(watch, 0, "", args.seconds)
        for kind in SERVERS:
            rows[kind]["idle"] = idle
        for kind in SERVERS:
            port, stop = serve_registry(kind, watch)
            try:
                printed = io.StringIO()
                with redirect_stderr(printed):
                    rows[kind]["unread_pages"] = never_reading(port, "/runbook", args.seconds / 2)
                rows[kind]["unread_pages"]["tracebacks"] = printed.getvalue().count("Traceback")
                rows[kind]["forms"] = request_forms(port)
                rows[kind]["ordinary"] = trainer_under_scrapers(watch, port, "", args.seconds)
                rows[kind]["huge_accept"] = trainer_under_scrapers(watch, port, HUGE_ACCEPT, args.seconds)
            finally:
                stop()
    for kind in SERVERS:
        port, stop = serve(kind, big_app)
        printed = io.StringIO()
        try:
            with redirect_stderr(printed):
                rows[kind]["unread_4mb"] = never_reading(port, "/big", args.seconds / 2)
                stop()
                time.sleep(0.5)            # prometheus_client's blocked writers fail now that the clients left
        finally:
            rows[kind]["unread_4mb"]["tracebacks"] = printed.getvalue().count("Traceback")
        rows[kind]["no_threads"] = without_threads(kind, big_app)
        rows[kind]["no_descriptors"] = out_of_descriptors(kind)
    report(rows)


def report(rows: dict[str, dict[str, dict]]) -> None:
    def line(label: str, cell: Callable[[dict[str, dict]], str]) -> None:
        print(f"| {label} | " + " | ".join(cell(rows[kind]) for kind in SERVERS) + " |")

    print("| scenario | " + " | ".join(SERVERS) + " |")
    print("|---|" + "---|" * len(SERVERS))
    for key, label in (("unread_pages", "8 never-reading clients on /runbook (54 KB)"),
                       ("unread_4mb", "8 never-reading clients on a 4 MB answer")):
        line(label + ": scrapes ok / failed, p99, max",
             lambda r, k=key: f"{r[k]['ok']} / {r[k]['failed']}, {r[k]['p99']:.3f} s, {r[k]['max']:.3f} s"
                              f"{', %d tracebacks' % r[k]['tracebacks'] if r[k]['tracebacks'] else ''}")
    line("observe p99, no scraper (steps): the same run for both",
         lambda r: f"{r['idle']['p99_ms']:.1f} ms ({r['idle']['steps']})")
    line("observe p99, 8 ordinary scrapers (steps; scrapes)",
         lambda r: f"{r['ordinary']['p99_ms']:.1f} ms ({r['ordinary']['steps']}; {r['ordinary']['scrapes']})")
    line("observe p99, 8 scrapers with 15 KB Accept headers (steps; scrapes)",
         lambda r: f"{r['huge_accept']['p99_ms']:.1f} ms ({r['huge_accept']['steps']}; "
                   f"{r['huge_accept']['scrapes']})")
    line("ratio of the two p99 (bar: <= 1.5)", lambda r: f"{r['huge_accept']['p99_ms'] / r['ordinary']['p99_ms']:.2f}")
    line("no thread can start: scrapes served of 5, tracebacks, close()",
         lambda r: f"{r['no_threads']['served']}, {r['no_threads']['tracebacks']}, {r['no_threads']['close_s']:.2f} s")
    line("no descriptor left: CPU seconds in 2 s; waiting clients served after",
         lambda r: f"{r['no_descriptors']['cpu_s_in_2s']:.2f} s; {r['no_descriptors']['served_after']} of 3")
    line("HTTP/0.9 `GET /metrics`: answered in; absolute-form request: status",
         lambda r: (f"{r['forms']['http09_s']:.3f} s" if r['forms']['http09_served'] else "no answer in 6 s")
                   + "; "
                   f"{r['forms']['absolute_status']}")


if __name__ == "__main__":
    main()
