"""Watch end to end: the real HTTP endpoint, the store, errors, ranks, push and OpenTelemetry."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import rlwatch
from rlwatch import InvalidFieldError, PortInUseError
from rlwatch.runs.store import StoreReader

from tests.conftest import ROOT, free_port, make_step, need_binary, self_signed_cert


def scrape(url: str, **kwargs) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5, **kwargs) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            s.labels.pop("run_instance", None)          # the keys name the run only
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_scraped_values_match_the_observed_record(tmp_path):
    step = make_step(B=16, T=32, seed=5)
    with rlwatch.Watch(run="e2e", port=0, store=str(tmp_path / "s.db"), strict=True) as watch:
        values = watch.observe(3, **step)
        samples = scrape(watch.url)
        assert watch.url.startswith("http://127.0.0.1:")
        r = (step["trainer_logp"] - step["sampler_logp"])[step["mask"]].double()
        k3 = float((torch.expm1(r) - r).mean())
        assert sample(samples, "rlwatch_mismatch_kl_k3", run="e2e") == pytest.approx(k3, rel=1e-5)
        assert sample(samples, "rlwatch_step", run="e2e") == 3
        assert sample(samples, "rlwatch_tokens_total", run="e2e") == int(step["mask"].sum())
        lag = (10 - step["token_version"])[step["mask"]]
        assert sample(samples, "rlwatch_token_version_lag_bucket", run="e2e", le="2.0") == int((lag <= 2).sum())
        assert sample(samples, "rlwatch_token_version_lag_count", run="e2e") == lag.numel()
        assert sample(samples, "rlwatch_token_version_lag_sum", run="e2e") == int(lag.sum())
        rewards = step["rewards"]
        math_reward = float(rewards[0::2].mean())
        assert sample(samples, "rlwatch_env_reward_mean", run="e2e", env="math") == pytest.approx(math_reward)
        # Every exported value equals the value observe() returned.
        for name, family in values.items():
            spec = rlwatch.core.metrics.BY_NAME.get(name)
            if spec is None or spec.kind != "gauge":
                continue
            for labels, value in family.items():
                if value is not None:
                    key = dict(zip(("run", *spec.labels), ("e2e", *labels)))
                    assert sample(samples, spec.full_name, **key) == pytest.approx(value), name
        watch.flush()
    with StoreReader(str(tmp_path / "s.db")) as store:
        row = store.steps("e2e")[0]
        assert row.step == 3
        assert row.get("mismatch_kl_k3") == pytest.approx(k3, rel=1e-5)
        assert store.meta("e2e")["framework"] == "custom"


def test_background_mode_exports_the_same_steps_in_order(tmp_path):
    """Watch(background=True): observe() returns at once, and after flush() the endpoint and the store
    hold exactly what the same steps give when computed on the calling thread."""
    steps = [make_step(B=8, T=16, seed=s) for s in range(12)]
    results = {}

    def in_a_new_thread() -> int:
        seen: list[int] = []
        spawned = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        spawned.start()
        spawned.join()
        return seen[0]

    for mode in ("inline", "background"):
        store = str(tmp_path / f"{mode}.db")
        # This thread's setting and the one threads started later get, before the Watch: neither changes.
        threads, threads_later = torch.get_num_threads(), in_a_new_thread()
        with rlwatch.Watch(run=mode, port=0, store=store, background=mode == "background") as watch:
            returned = [watch.observe(i, **step) for i, step in enumerate(steps)]
            watch.log_scalars(11, {"loss": 0.5})
            assert watch.flush()
            samples = scrape(watch.url)
            assert torch.get_num_threads() == threads
            assert in_a_new_thread() == threads_later
        with StoreReader(store) as reader:
            rows = reader.steps(mode)
        results[mode] = (returned, samples, rows)
    returned, samples, rows = results["background"]
    assert returned == [None] * 12
    assert [r.step for r in rows] == list(range(12))
    for a, b in zip(results["inline"][2], rows, strict=True):
        assert {k: v for k, v in a.values.items() if "seconds" not in k} == \
               {k: v for k, v in b.values.items() if "seconds" not in k}
    assert sample(samples, "rlwatch_steps_total", run="background") == 12
    assert sample(samples, "rlwatch_mismatch_kl_k3", run="background") == \
        sample(results["inline"][1], "rlwatch_mismatch_kl_k3", run="inline")
    assert samples[("rlwatch_framework_metric", (("name", "loss"), ("run", "background")))] == 0.5


def test_background_errors_are_counted_and_close_computes_what_is_queued(tmp_path):
    watch = rlwatch.Watch(run="bg", port=None, store=str(tmp_path / "bg.db"), background=True)
    watch.observe(0, mask=torch.ones(2, 3), trainer_logp=torch.zeros(5))            # bad shape
    watch.defer(lambda: 1 / 0)
    for i in range(1, 30):
        watch.observe(i, **make_step(seed=i))
    watch.close()                                                                   # no flush first
    assert watch.errors.counts[("validate", "shape")] == 1
    assert watch.errors.counts[("background", "ZeroDivisionError")] == 1
    with StoreReader(str(tmp_path / "bg.db")) as reader:
        rows = reader.steps("bg")
    assert [r.step for r in rows] == list(range(30))          # step 0 without its bad field
    assert rows[0].get("mismatch_kl_k3") is None and rows[1].get("mismatch_kl_k3") is not None


def test_counters_accumulate_and_gauges_go_stale(tmp_path):
    with rlwatch.Watch(run="acc", port=0, store=None, strict=True) as watch:
        a, b = make_step(seed=1), make_step(seed=2)
        watch.observe(0, **a)
        watch.observe(1, mask=b["mask"])    # no log-probs this step
        samples = scrape(watch.url)
        assert sample(samples, "rlwatch_tokens_total", run="acc") == int(a["mask"].sum() + b["mask"].sum())
        assert sample(samples, "rlwatch_steps_total", run="acc") == 2
        assert ("rlwatch_mismatch_kl_k3", (("run", "acc"),)) not in samples   # not computed at step 1
        assert sample(samples, "rlwatch_is_cap", run="acc") == 2.0             # settings persist


def test_exposition_passes_promtool(tmp_path):
    promtool = need_binary("promtool")
    with rlwatch.Watch(run='quote"run', port=0, store=None) as watch:
        step = make_step(seed=4)
        step.update(env=['a"b', "new\nline"] * 8, hacked={"verifier": torch.ones(16, dtype=torch.bool)},
                    failed=[None] * 15 + ["timeout"], entropy=torch.rand(16, 32), temperature=0.6,
                    logprobs_mode="processed_logprobs")
        watch.observe(0, **step)
        watch.log_scalars(0, {"actor/grad_norm": 2.0, "weird name {x}": 1.0})
        text = urllib.request.urlopen(watch.url).read()
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_busy_port_is_a_clear_error_or_falls_back():
    with rlwatch.Watch(run="a", port=0, store=None) as first:
        with pytest.raises(PortInUseError, match="port_fallback"):
            rlwatch.Watch(run="b", port=first.port, store=None, strict=True)
        second = rlwatch.Watch(run="b", port=first.port, store=None)       # default: counted, no endpoint
        assert second.url is None
        assert second.errors.counts[("export", "port")] == 1
        second.close()
        third = rlwatch.Watch(run="c", port=first.port, port_fallback=True, store=None)
        assert third.port not in (None, first.port)
        assert scrape(third.url) is not None
        third.close()


def test_bad_input_never_raises_by_default(caplog):
    caplog.set_level(logging.WARNING, logger="rlwatch")
    with rlwatch.Watch(run="bad", port=None, store=None) as watch:
        step = make_step()
        step["sampler_logp"] = torch.zeros(3, 3)       # wrong shape: dropped, rest still computed
        step["rewards"] = "not numbers"
        values = watch.observe(0, **step)
        assert values is not None and "version_lag_mean" in values and "mismatch_kl_k3" not in values
        assert watch.observe(1, mask=None) is None
        watch.observe(2, **step)
        counts = watch.errors.counts
        assert counts[("validate", "shape")] == 2 and counts[("validate", "missing")] == 1
        messages = [r.getMessage() for r in caplog.records]
        assert sum("(shape)" in m for m in messages) == 1          # logged once per kind
        assert any("sampler_logp" in m for m in messages)
    with rlwatch.Watch(run="strict", port=None, store=None, strict=True) as watch:
        with pytest.raises(InvalidFieldError) as info:
            watch.observe(0, **step)
        assert info.value.field == "sampler_logp"


def test_hook_errors_are_exported(tmp_path):
    with rlwatch.Watch(run="err", port=0, store=None) as watch:
        watch.observe(0, mask=torch.ones(2, 2), sampler_logp=torch.zeros(2, 3), trainer_logp=torch.zeros(2, 2))
        samples = scrape(watch.url)
        assert sample(samples, "rlwatch_hook_errors_total", run="err", stage="validate", kind="shape") == 1


def test_a_failing_listener_is_counted_under_its_own_stage_and_the_step_still_exports(monkeypatch):
    from rlwatch.analyses.diagnosis import Diagnoser
    from rlwatch.analyses.drift import DriftDetector

    def fails(self, step, values):
        raise RuntimeError(f"{type(self).__name__} failed")

    class Broken:
        on_step = fails

        def close(self):
            raise OSError("close failed")

    monkeypatch.setattr(DriftDetector, "on_step", fails)
    monkeypatch.setattr(Diagnoser, "on_step", fails)
    with rlwatch.Watch(run="stages", port=0, store=None, alerts=True, listeners=(Broken(),)) as watch:
        watch.observe(4, **make_step(seed=2))
        samples = scrape(watch.url)
    for stage in ("drift", "diagnosis", "listener"):
        assert sample(samples, "rlwatch_hook_errors_total", run="stages", stage=stage, kind="RuntimeError") == 1
    assert watch.errors.snapshot() == {("drift", "RuntimeError"): 1, ("diagnosis", "RuntimeError"): 1,
                                       ("listener", "RuntimeError"): 1, ("listener", "close"): 1}
    assert sample(samples, "rlwatch_step", run="stages") == 4
    assert ("rlwatch_mismatch_kl_k3", (("run", "stages"),)) in samples
    assert any(name == "rlwatch_alert_value" for name, _ in samples)    # the alert windows ran after them


def test_store_is_readable_while_the_run_writes(tmp_path):
    path = str(tmp_path / "live.db")
    with rlwatch.Watch(run="live", port=None, store=path) as watch:
        for i in range(5):
            watch.observe(i, **make_step(seed=i))
        watch.flush()
        with StoreReader(path) as reader:
            assert [r.step for r in reader.steps("live")] == [0, 1, 2, 3, 4]
        watch.record_checkpoint(4, "/ckpt/checkpoint-4")
        watch.record_checkpoint(5, "out/checkpoint-5")              # relative: stored absolute
        watch.record_checkpoint(6, "s3://bucket/run/checkpoint-6")  # a URL: kept as given
        watch.log_scalars(4, {"loss": 0.5})
        watch.flush()
        with StoreReader(path) as reader:
            assert reader.checkpoints("live") == [(4, "/ckpt/checkpoint-4"),
                                                  (5, os.path.join(os.getcwd(), "out", "checkpoint-5")),
                                                  (6, "s3://bucket/run/checkpoint-6")]
            assert reader.scalars("live") == {"loss": [(4, 0.5)]}


KILL_CHILD = textwrap.dedent("""
    import sys, time, torch, rlwatch
    sys.path.insert(0, {root!r})
    from tests.conftest import make_step
    watch = rlwatch.Watch(run="killed", port=None, store={path!r})
    for step in range(100000):
        watch.observe(step, **make_step(B=8, T=16, seed=step))
        watch.flush()
        print(step, flush=True)
        time.sleep(0.01)
""")


def test_sigkill_mid_run_leaves_every_completed_step(tmp_path):
    import queue
    import time

    path = str(tmp_path / "killed.db")
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD.format(root=str(ROOT), path=path)],
                             stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:                      # a hung child must not block the suite: read on a thread
        for line in child.stdout:
            lines.put(line)
        lines.put(None)                      # EOF: the child exited or closed its output

    reader_thread = threading.Thread(target=read, daemon=True)
    reader_thread.start()
    last = -1
    try:
        deadline = time.monotonic() + 120
        while last < 30:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the child reported only {last + 1} steps in 120 s")
            assert line is not None, f"the child exited (rc={child.poll()}) after only {last + 1} steps"
            assert int(line) == last + 1, line
            last = int(line)
        assert child.poll() is None, "the child must still be running when it is killed"
    finally:
        if child.poll() is None:                         # not yet reaped: its PID is still its own
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        reader_thread.join(timeout=10)                   # EOF once the child is gone
        child.stdout.close()
    with StoreReader(path) as reader:
        steps = [r.step for r in reader.steps("killed")]
    assert len(steps) >= last + 1 >= 31                  # every step the child reported before the kill
    assert steps == list(range(len(steps)))              # contiguous: nothing half-written


def test_pushgateway_receives_the_run(pushgateway):
    with rlwatch.Watch(run="pushed", port=None, store=None, pushgateway=pushgateway.url, push_interval=0.2) as w:
        w.observe(0, **make_step())
    samples = scrape(pushgateway.url + "/metrics")
    keys = [k for k in samples if k[0] == "rlwatch_steps_total" and ("run", "pushed") in k[1]]
    assert keys and samples[keys[0]] == 1


def test_pushgateway_keeps_two_processes_of_one_run_apart(pushgateway):
    """Two processes pushing one run name: one group each (grouping key run + run_instance), neither
    replaces the other's metrics."""
    twins = [rlwatch.Watch(run="twin", port=None, store=None, pushgateway=pushgateway.url, push_interval=60)
             for _ in range(2)]
    for count, watch in enumerate(twins, start=1):
        for step in range(count):
            watch.observe(step, **make_step(seed=step))
        watch.close()
    text = urllib.request.urlopen(pushgateway.url + "/metrics", timeout=5).read().decode()
    totals = {s.labels.get("run_instance"): s.value for family in text_string_to_metric_families(text)
              for s in family.samples if s.name == "rlwatch_steps_total" and s.labels.get("run") == "twin"}
    assert totals == {twins[0].run_instance: 1, twins[1].run_instance: 2}


def test_pushgateway_down_never_blocks_or_raises():
    port = free_port()
    with rlwatch.Watch(run="nopush", port=None, store=None, pushgateway=f"http://127.0.0.1:{port}",
                       push_interval=0.05) as watch:
        watch.observe(0, **make_step())
    assert watch.errors.counts[("export", "push")] >= 1


RANK_CHILD = textwrap.dedent("""
    import os, sys, json, urllib.request, rlwatch, torch
    sys.path.insert(0, {root!r})
    from tests.conftest import make_step
    w = rlwatch.Watch(run="ddp", port={port}, store=None, all_ranks={all_ranks})
    w.observe(0, **make_step())
    body = urllib.request.urlopen(w.url).read().decode() if w.url else ""
    print(json.dumps(dict(rank=w.rank, active=w.active, run=w.run, url=w.url, has=("rlwatch_steps_total" in body))))
    w.close()
""")


@pytest.mark.slow
@pytest.mark.parametrize("all_ranks", [False, True])
def test_several_ranks_on_one_node(all_ranks):
    port = free_port()
    results = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        out = subprocess.run([sys.executable, "-c", RANK_CHILD.format(root=str(ROOT), port=port,
                                                                      all_ranks=all_ranks)],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert results[0]["active"] and results[0]["has"]
    if all_ranks:
        assert results[1]["active"] and results[1]["has"]
        assert results[1]["run"] == "ddp-rank1" and results[1]["url"].endswith(f":{port + 1}/metrics")
    else:
        assert not results[1]["active"] and results[1]["url"] is None


def test_opentelemetry_in_memory_reader():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    step = make_step()
    with rlwatch.Watch(run="otel", port=None, store=None, otel=provider) as watch:
        values = watch.observe(0, **step)
        data = reader.get_metrics_data()
    points = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    attributes = dict(point.attributes)
                    assert attributes.pop("run_instance") == watch.run_instance
                    points[(metric.name, tuple(sorted(attributes.items())))] = point.value
    assert points[("rlwatch_mismatch_kl_k3", (("run", "otel"),))] == pytest.approx(values["mismatch_kl_k3"][()])
    assert points[("rlwatch_tokens", (("run", "otel"),))] == int(step["mask"].sum())
    assert points[("rlwatch_env_episodes", (("env", "math"), ("run", "otel")))] == 8
    assert points[("rlwatch_token_version_lag_tokens", (("le", "+Inf"), ("run", "otel")))] == int(step["mask"].sum())
    provider.shutdown()


class _OTLPReceiver(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        _OTLPReceiver.received.append((self.path, request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_opentelemetry_otlp_http_to_a_local_receiver():
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    server = HTTPServer(("127.0.0.1", 0), _OTLPReceiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _OTLPReceiver.received = []
    try:
        exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{server.server_address[1]}/v1/metrics")
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=60_000)
        provider = MeterProvider(metric_readers=[reader])
        with rlwatch.Watch(run="otlp", port=None, store=None, otel=provider) as watch:
            values = watch.observe(0, **make_step())
            provider.force_flush()
        provider.shutdown()
    finally:
        server.shutdown()
    assert _OTLPReceiver.received, "no OTLP export arrived"
    path, request = _OTLPReceiver.received[0]
    assert path == "/v1/metrics"
    found = {}
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "rlwatch_mismatch_kl_k3":
                    found["k3"] = metric.gauge.data_points[0].as_double
    assert found["k3"] == pytest.approx(values["mismatch_kl_k3"][()])


def test_tls_and_basic_auth(tmp_path):
    import ssl

    cert, key = self_signed_cert(tmp_path)
    with rlwatch.Watch(run="tls", port=0, store=None, tls_certfile=cert, tls_keyfile=key,
                       basic_auth=("prom", "s3cret")) as watch:
        watch.observe(0, **make_step())
        assert watch.url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=cert)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(watch.url, context=context, timeout=5)
        assert info.value.code == 401
        request = urllib.request.Request(watch.url, headers={"Authorization": "Basic cHJvbTpzM2NyZXQ="})
        body = urllib.request.urlopen(request, context=context, timeout=5).read().decode()
        assert f'rlwatch_steps_total{{run="tls",run_instance="{watch.run_instance}"}} 1.0' in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):   # plain HTTP is refused
            urllib.request.urlopen(watch.url.replace("https", "http"), timeout=5)


def test_a_stuck_background_thread_never_blocks_the_trainer_for_long():
    """A job that never ends (say a user's guard hanging on a network file system) fills the queue;
    observe() then waits at most the worker's max_wait before dropping the step, counted."""
    import time

    release = threading.Event()
    watch = rlwatch.Watch(run="stuck", port=None, store=None, background=True)
    watch._worker.max_wait = 0.2
    watch.defer(release.wait)
    step = make_step(B=2, T=4)
    start = time.perf_counter()
    for i in range(70):                                  # the queue holds 64
        watch.observe(i, **step)
    assert time.perf_counter() - start < 5
    assert watch.errors.counts[("background", "TimeoutError")] >= 1
    release.set()
    watch.close()


def test_an_idle_tls_client_neither_stops_scrapes_nor_hangs_close(tmp_path):
    """A TCP client that connects to the TLS endpoint and never starts the handshake: other scrapes
    are served at once and close() returns promptly (the handshake runs on the connection's thread,
    with a timeout, not inside accept on the server's only thread)."""
    import socket
    import ssl
    import time

    cert, key = self_signed_cert(tmp_path)
    watch = rlwatch.Watch(run="tlsidle", port=0, store=None, alerts=False, tls_certfile=cert, tls_keyfile=key)
    idle = socket.create_connection(("127.0.0.1", watch.port))
    try:
        watch.observe(0, **make_step())
        time.sleep(0.2)                                    # the idle client is accepted first
        context = ssl.create_default_context(cafile=cert)
        start = time.perf_counter()
        body = urllib.request.urlopen(watch.url, context=context, timeout=5).read().decode()
        assert time.perf_counter() - start < 2
        assert f'rlwatch_steps_total{{run="tlsidle",run_instance="{watch.run_instance}"}} 1.0' in body
        start = time.perf_counter()
        watch.close()
        assert time.perf_counter() - start < 3
    finally:
        idle.close()
        watch.close()


def _threads_named(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def test_idle_plain_http_clients_time_out_and_are_capped():
    """Many clients that connect and say nothing: they hold no thread, at most max_connections are
    held (the longest waiting is dropped for a newcomer, so a scrape is answered at once), the rest
    are cut at their head deadline, and no thread outlives its request."""
    import socket
    import time

    from prometheus_client import CollectorRegistry

    from rlwatch.exporters.http import MetricsServer

    before = threading.active_count()
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, header_timeout=1.0, max_connections=8)
    clients = []
    try:
        most = 0
        for _ in range(30):
            clients.append(socket.create_connection(("127.0.0.1", server.port)))
            most = max(most, threading.active_count())
        assert most <= before + 1                              # the accepting thread only
        start = time.monotonic()
        assert urllib.request.urlopen(server.url, timeout=2).status == 200
        assert time.monotonic() - start < 0.9                  # before any head deadline
        time.sleep(1.5)
        for client in clients:                                 # every idle one was closed by the server
            client.settimeout(2)
            status = client.recv(100).split(b"\r\n")[0]
            assert status in (b"HTTP/1.0 408 Request Timeout", b"HTTP/1.0 503 Service Unavailable"), status
        deadline = time.monotonic() + 5
        while threading.active_count() > before + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before + 1          # the accepting thread only
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_non_ascii_basic_auth_header_is_refused_quietly(capfd):
    """An Authorization header with non-ASCII bytes: 401, and nothing printed to the trainer's stderr."""
    import socket

    with rlwatch.Watch(run="auth", port=0, store=None, alerts=False, basic_auth=("prom", "s3cret")) as watch:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", watch.port), timeout=5) as sock:
                sock.sendall(b"GET /metrics HTTP/1.0\r\nAuthorization: Basic \xc3\xbc\xff==\r\n\r\n")
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.0 401"), answer[:80]
        assert not any(stage == "export" and kind == "server" for stage, kind in watch.errors.counts)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "TypeError" not in err, err


def test_background_queue_is_bounded_by_bytes():
    """Steps of 4 MiB of tensors each, observed faster than a slow rlwatch thread computes them:
    the queue never holds more than background_max_bytes (plus one step), and every step's tensors
    are freed once it ran (checked with weak references, as memory on an accelerator would be)."""
    import weakref

    slow = threading.Event()

    class Slow:
        def on_step(self, step, values):
            slow.wait(0.05)

        def close(self):
            pass

    step_bytes = 4 << 20
    watch = rlwatch.Watch(run="bytes", port=None, store=None, alerts=False, background=True,
                          background_max_bytes=4 * step_bytes, listeners=(Slow(),))
    alive: list = []
    most = 0
    try:
        for i in range(20):
            step = make_step(B=2, T=8, seed=i)
            step["entropy"] = torch.rand(2, 8)
            step["filler"] = torch.zeros(step_bytes // 4)           # an unknown field: held, never used
            alive.append(weakref.ref(step["filler"]))
            watch.observe(i, **step)
            del step
            most = max(most, sum(ref() is not None for ref in alive))
        assert watch.flush(30)
    finally:
        watch.close()
    assert most <= 5, most                         # 4 queued + the one being submitted
    assert watch._worker.peak_bytes <= 4 * step_bytes + step_bytes
    assert sum(ref() is not None for ref in alive) == 0


def test_close_while_other_threads_observe_is_prompt_and_counts_what_it_refused():
    """Threads keep observing while the background Watch closes: close() returns in seconds, every
    step is either computed or counted as refused after close."""
    import time

    watch = rlwatch.Watch(run="closing", port=None, store=None, alerts=False, background=True)
    step = make_step(B=4, T=8)
    stop = threading.Event()
    submitted = [0, 0, 0]

    def observe_forever(k):
        i = 0
        while not stop.is_set():
            watch.observe(k * 1_000_000 + i, **step)
            submitted[k] += 1
            i += 1

    threads = [threading.Thread(target=observe_forever, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.perf_counter()
    watch.close()
    closing = time.perf_counter() - start
    stop.set()
    for t in threads:
        t.join()
    assert closing < 5, closing
    computed = int(watch.state.snapshot().counters["steps_total"][()])
    refused = watch.errors.counts[("observe", "after_close")]
    assert computed + refused == sum(submitted), (computed, refused, submitted)
    assert refused > 0


_KILL_AFTER = textwrap.dedent("""
    import os, signal, sys
    import rlwatch
    from tests.conftest import make_step
    path, steps, background, point = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    watch = rlwatch.Watch(run="durable", port=None, store=path, alerts=False, background=background)
    for i in range(steps):
        watch.observe(i, **make_step(B=4, T=8, seed=i))
    if point == "checkpoint":
        watch.record_checkpoint(steps - 1, "/tmp/ckpt")
    else:
        assert watch.flush()
    os.kill(os.getpid(), signal.SIGKILL)         # right after: nothing else runs
""")


@pytest.mark.parametrize("point,background", [("checkpoint", False), ("checkpoint", True), ("flush", True)])
def test_steps_before_flush_or_a_checkpoint_survive_sigkill_right_after(tmp_path, point, background):
    """What observe promises: a step is in the store once flush() returned True, and
    record_checkpoint() flushes; a SIGKILL right after loses none of those steps."""
    import sqlite3

    root = Path(__file__).resolve().parents[1]
    for trial, steps in enumerate((13,)):
        path = str(tmp_path / f"d{trial}.db")
        proc = subprocess.run([sys.executable, "-c", _KILL_AFTER, path, str(steps), str(int(background)), point],
                              cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        with sqlite3.connect(path) as conn:
            stored = [r[0] for r in conn.execute("SELECT step FROM steps WHERE run = 'durable' ORDER BY step")]
            checkpoints = conn.execute("SELECT step FROM checkpoints").fetchall()
        assert stored == list(range(steps)), (trial, stored)
        if point == "checkpoint":
            assert checkpoints == [(steps - 1,)]


def _spiking_watch(run: str, **options) -> rlwatch.Watch:
    """A Watch whose KLSpike (critical) fires at step 1 of make_step(noise=0.5) steps."""
    return rlwatch.Watch(run=run, port=None, store=None, alerts=True, alert_overrides={"kl_k3_max": 0.01}, **options)


def test_an_alert_callback_may_call_the_watch_and_its_evaluator():
    """An on_alert callback that reads what is firing and notes it on the Watch (on main: a deadlock,
    the evaluator held its non-reentrant lock while it ran the callback)."""
    watch = _spiking_watch("callback")
    seen = []

    def callback(event):
        seen.append((event.name, event.state, sorted(e.name for e in watch.evaluator.firing())))
        watch.note("alert_seen", event.name)

    watch.on_alert(callback)

    def train():
        for step in range(3):
            watch.observe(step, **make_step(seed=step, noise=0.5))
        watch.close()

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    trainer.join(timeout=60)
    assert not trainer.is_alive(), "the training thread is stuck in an on_alert callback"
    assert ("RLWatchKLSpike", "firing", ["RLWatchKLSpike"]) in seen, seen
    assert watch.errors.total() == 0


def test_a_slow_guard_never_holds_observe_and_a_failing_one_is_counted():
    """A 10 s guard runs on rlwatch's alert-actions thread: the step that fired returns at once (on
    main it took the guard's 10 s); a guard that raises is counted, and the others still run."""
    release, ran = threading.Event(), []

    def slow(event):
        ran.append(event.name)
        release.wait(10)

    def failing(event):
        raise RuntimeError("guard bug")

    watch = _spiking_watch("guards", guard=(failing, slow))
    durations = []
    try:
        for step in range(3):
            start = time.perf_counter()
            watch.observe(step, **make_step(seed=step, noise=0.5))
            durations.append(time.perf_counter() - start)
        assert max(durations) < 2.0, durations          # the guard would hold it 10 s
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["RLWatchKLSpike"]
    finally:
        release.set()
    watch.close()
    assert watch.errors.counts[("alerts", "guard")] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_an_invalid_token_version_is_left_out_of_the_lag_and_counted_never_paged(bad):
    """One NaN (or infinite, or negative) version among 256 with trainer_version 1000: on main NaN
    became version 0, a lag of 1000 and a critical RLWatchVersionLagFarAboveBound; now the token is
    left out of the lag signals and counted as a validate error."""
    B, T = 16, 16
    fields = make_step(B=B, T=T, lag_max=0, noise=0.0)
    fields["mask"] = torch.ones(B, T, dtype=torch.bool)
    version = torch.full((B, T), 999.0)
    version[3, 5] = bad
    fields.update(token_version=version, trainer_version=1000)
    with rlwatch.Watch(run="versions", port=None, store=None, alerts=True, staleness_bound=2) as watch:
        for step in range(4):
            values = watch.observe(step, **fields)
        assert values.value("version_lag_max") == 1.0
        assert values.value("version_lag_mean") == pytest.approx(1.0)
        assert watch.errors.counts[("validate", "negative_lag")] == 4
        assert [e.name for e in watch.evaluator.events] == []


def test_pushgateway_last_push_leaves_no_incident_open(pushgateway):
    """A run that ends during an incident: the gateway keeps the last push forever, so that push
    shows the incident resolved (delivered once by the rules' resolved branch), never open."""
    with rlwatch.Watch(run="spiked", port=None, store=None, alerts=True, pushgateway=pushgateway.url,
                       push_interval=60) as w:
        for step in range(8):
            w.observe(step, **make_step(seed=step, noise=3.0 if step >= 3 else 0.01))
        assert any(e.name == "RLWatchKLSpike" for e in w.evaluator.firing())
    text = urllib.request.urlopen(pushgateway.url + "/metrics", timeout=5).read().decode()
    states = [(s.labels["alert"], s.labels["state"]) for family in text_string_to_metric_families(text)
              for s in family.samples if s.name == "rlwatch_alert_incident" and s.labels.get("run") == "spiked"]
    assert ("RLWatchKLSpike", "resolved") in states
    assert not [state for _, state in states if state == "open"], states
