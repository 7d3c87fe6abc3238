"""Faults around the hook: a full or read-only store, an unusable store path, a hanging OTLP
receiver. Training continues, the loss is bounded and reported, the store keeps what completed."""

from __future__ import annotations

import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

import rlwatch
from rlwatch.store import StoreReader

from .conftest import make_step


def _pragma(watch, sql: str) -> None:
    watch.store._put((sql, ()))          # executed by the writer thread, in order with the steps
    watch.flush()


@pytest.mark.parametrize("fault,recover", [
    ("PRAGMA max_page_count = 1", "PRAGMA max_page_count = 1073741823"),     # SQLITE_FULL: disk full
    ("PRAGMA query_only = ON", "PRAGMA query_only = OFF"),                    # SQLITE_READONLY
])
def test_store_full_or_read_only_never_stops_training(tmp_path, fault, recover):
    path = str(tmp_path / "s.db")
    with rlwatch.Watch(run="f", port=0, store=path) as watch:
        for step in range(5):
            watch.observe(step, **make_step(seed=step))
        watch.flush()
        _pragma(watch, fault)
        for step in range(5, 10):
            assert watch.observe(step, **make_step(seed=step)) is not None     # training continues
        watch.flush()
        assert watch.store.dropped == 5
        assert watch.errors.counts[("store", "write")] >= 1
        import urllib.request
        text = urllib.request.urlopen(watch.url).read().decode()
        assert 'rlwatch_store_dropped_steps_total{run="f"} 5.0' in text
        _pragma(watch, recover)
        for step in range(10, 13):
            watch.observe(step, **make_step(seed=step))
    with StoreReader(path) as store:
        steps = [r.step for r in store.steps("f")]
        events = store.events("f")
    assert steps == [0, 1, 2, 3, 4, 10, 11, 12]                  # every step outside the fault window
    assert any(e["kind"] == "data_loss" and "5 store rows" in e["detail"] for e in events)


def test_unusable_store_path_disables_the_store_only(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with rlwatch.Watch(run="nostore", port=None, store=str(blocker / "s.db")) as watch:
        assert watch.store is None
        assert watch.observe(0, **make_step()) is not None
    assert watch.errors.counts[("store", "open")] == 1


class _Hang(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        time.sleep(5)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_hanging_otlp_receiver_never_blocks_the_training_thread():
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    server = HTTPServer(("127.0.0.1", 0), _Hang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{server.server_address[1]}/v1/metrics", timeout=1)
    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(exporter, export_interval_millis=50)])
    try:
        with rlwatch.Watch(run="otlp-hang", port=None, store=None, otel=provider, alerts=False) as watch:
            durations = []
            for step in range(20):
                start = time.perf_counter()
                watch.observe(step, **make_step(seed=step))
                durations.append(time.perf_counter() - start)
                time.sleep(0.05)
        assert max(durations) < 0.5, durations
    finally:
        provider.shutdown(timeout_millis=2000)
        server.shutdown()


def test_hanging_pushgateway_and_a_stalled_scraper_never_block_training(pushgateway):
    """A Pushgateway that accepts and never answers (the real one, frozen with SIGSTOP: the kernel
    still accepts its connections) and a scraper that opens /metrics and stalls mid-request: every
    observe returns at once, other scrapes are served, close() is bounded, and the failed pushes are
    counted."""
    import socket
    import urllib.request

    os.kill(pushgateway.proc.pid, signal.SIGSTOP)
    stalled = None
    watch = None
    try:
        watch = rlwatch.Watch(run="hang", port=0, store=None, alerts=False, push_interval=0.05,
                              pushgateway=pushgateway.url)
        watch.push.timeout = 1.0
        stalled = socket.create_connection(("127.0.0.1", watch.port))
        stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")          # never finished
        durations = []
        for step in range(20):
            start = time.perf_counter()
            watch.observe(step, **make_step(seed=step))
            durations.append(time.perf_counter() - start)
            time.sleep(0.05)
        body = urllib.request.urlopen(watch.url, timeout=5).read().decode()
        assert 'rlwatch_steps_total{run="hang"} 20.0' in body
        start = time.perf_counter()
        watch.close()
        closing = time.perf_counter() - start
        assert max(durations) < 0.5, durations
        assert closing < 2 * watch.push.timeout + 2, closing
        assert watch.push.pushes == 0                   # the frozen gateway never answered a push
        assert watch.errors.counts[("export", "push")] >= 1
    finally:
        if stalled is not None:
            stalled.close()
        os.kill(pushgateway.proc.pid, signal.SIGCONT)    # before the fixture stops it by its PID
        if watch is not None:
            watch.close()                                # idempotent; bounded on a failure above
