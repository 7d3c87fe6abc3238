"""The /metrics endpoint as scrapers and users meet it: the port is free again right after a run
that was scraped exits, a port in use still fails, OpenMetrics is negotiated like prometheus_client
does, and the runbook the alerts link to by default is served."""

from __future__ import annotations

import gzip
import re
import socket
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import rlwatch
from rlwatch import resources
from rlwatch.alerts import render
from rlwatch.alerts.catalogue import ALERTS
from rlwatch.errors import PortInUseError
from rlwatch.exporters.prometheus import MetricsServer

from .conftest import make_step


def scrape_raw(port: int, accept: str | None = None, encoding: str | None = None,
               path: str = "/metrics") -> tuple[dict[str, str], bytes]:
    """One HTTP/1.0 request over a plain socket; returns (headers, body)."""
    headers = "".join(f"{k}: {v}\r\n" for k, v in (("Accept", accept), ("Accept-Encoding", encoding)) if v)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert " 200 " in lines[0], lines[0]
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}, body


def test_port_is_free_again_right_after_a_scraped_run_exits():
    """A scraped run leaves its server-side connections in TIME-WAIT; the next run (the quick start
    run twice) must still bind the same port at once, not fail or move to another port."""
    with rlwatch.Watch(run="first", port=0, store=None) as watch:
        port = watch.port
        watch.observe(0, **make_step())
        for _ in range(3):
            _, body = scrape_raw(port)                   # the server closes: its side goes to TIME-WAIT
            assert f'rlwatch_steps_total{{run="first",run_instance="{watch.run_instance}"}}'.encode() in body
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)   # a client still connected at exit
    try:
        with rlwatch.Watch(run="second", port=port, store=None, strict=True) as again:
            assert again.port == port
            again.observe(0, **make_step())
            assert b'run="second"' in scrape_raw(port)[1]
    finally:
        idle.close()


def test_a_port_someone_listens_on_still_fails_loudly():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(PortInUseError):
            MetricsServer(None, "127.0.0.1", other.getsockname()[1], app=lambda e, s: [b""])


def test_port_fallback_says_why_it_moved(caplog):
    caplog.set_level("WARNING", logger="rlwatch")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        server = MetricsServer(None, "127.0.0.1", taken, port_fallback=True, app=lambda e, s: [b""])
        try:
            assert server.port != taken
            assert any(f"cannot serve /metrics on 127.0.0.1:{taken}" in r.message and f"port {server.port} instead"
                       in r.message for r in caplog.records), [r.message for r in caplog.records]
        finally:
            server.close()


@pytest.fixture(scope="module")
def endpoint():
    with rlwatch.Watch(run="om", port=0, store=None) as watch:
        for step in range(2):
            watch.observe(step, **make_step())
        yield watch


def test_openmetrics_is_negotiated_from_the_accept_header(endpoint):
    # What Prometheus 2.x sends: OpenMetrics preferred, the text format as a fallback.
    prometheus_accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                         "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    headers, body = scrape_raw(endpoint.port, accept=prometheus_accept)
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n")
    assert "# TYPE rlwatch_steps counter" in body.decode()         # OpenMetrics names the counter family
    _, text = scrape_raw(endpoint.port)
    samples = lambda raw: sorted(line for line in raw.decode().splitlines() if line and not line.startswith("#"))
    assert samples(body) == samples(text)                           # the same series and values either way
    steps_total = f'rlwatch_steps_total{{run="om",run_instance="{endpoint.run_instance}"}} 2.0'
    assert steps_total in samples(body)
    # one family, cut out and parsed with prometheus_client's strict OpenMetrics parser
    k3 = "\n".join(line for line in body.decode().splitlines()
                   if re.match(r"(# \w+ )?rlwatch_mismatch_kl_k3[ {]", line)) + "\n# EOF\n"
    (family,) = text_string_to_metric_families(k3)
    assert family.type == "gauge" and family.samples[0].labels == {"run": "om",
                                                                   "run_instance": endpoint.run_instance}
    # gzip applies to either format; the cache keeps the two formats apart
    headers, zipped = scrape_raw(endpoint.port, accept=prometheus_accept, encoding="gzip")
    assert headers["content-encoding"] == "gzip" and gzip.decompress(zipped) == body
    for accept in (None, "text/plain;version=0.0.4", "*/*"):
        headers, text = scrape_raw(endpoint.port, accept=accept)
        assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert b"# EOF" not in text and steps_total.encode() in text
    assert "content-encoding" not in scrape_raw(endpoint.port, encoding="gzip;q=0")[0]


def test_the_runbook_is_served_where_the_alerts_link_by_default(endpoint):
    headers, page = scrape_raw(endpoint.port, path="/runbook")
    assert headers["content-type"] == "text/html; charset=utf-8"
    ids = set(re.findall(r'id="([\w-]+)"', page.decode()))
    rules = render.rules_yaml()
    for alert in ALERTS:
        url = f"{render.DEFAULT_RUNBOOK_URL}#{alert.name.lower()}"
        assert alert.name.lower() in ids and url in rules
    assert render.DEFAULT_RUNBOOK_URL == "http://127.0.0.1:9400/runbook"
    headers, markdown = scrape_raw(endpoint.port, path="/runbook.md")
    assert headers["content-type"].startswith("text/markdown")
    assert markdown.decode() == resources.runbook_markdown() == render.runbook_md()


def test_runbook_url_is_a_setting(monkeypatch, tmp_path):
    from rlwatch.stack import StackConfig, write_configs

    kl = next(a for a in ALERTS if a.name == "RLWatchKLSpike")
    assert kl.runbook_url == "http://127.0.0.1:9400/runbook#rlwatchklspike"
    monkeypatch.setenv("RLWATCH_RUNBOOK_URL", "https://wiki.example/rl/runbook")
    assert kl.runbook_url == "https://wiki.example/rl/runbook#rlwatchklspike"      # in-process alerts
    write_configs(StackConfig(tmp_path / "env"))                                    # rlwatch up
    assert "https://wiki.example/rl/runbook#rlwatchklspike" in (tmp_path / "env" / render.RULES_FILE).read_text()
    write_configs(StackConfig(tmp_path / "opt", runbook_url="https://team.example/rb"))   # --runbook-url
    assert "https://team.example/rb#rlwatchklspike" in (tmp_path / "opt" / render.RULES_FILE).read_text()
    assert (tmp_path / "opt" / render.RUNBOOK_FILE).read_text() == render.runbook_md()   # a local copy
    # the checked-in files stay the default whatever the environment says
    assert render.check(resources.root() / "alerts") == []
