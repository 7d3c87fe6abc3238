"""Watch's push deliveries end to end: a real Pushgateway (two processes of one run kept apart, a
gateway down never blocking, the last push leaving no incident open) and OpenTelemetry (an in-memory
reader, OTLP over HTTP to a local receiver)."""

from __future__ import annotations

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

import rlwatch

from .conftest import free_port, make_step
from ._watch_helpers import scrape


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
