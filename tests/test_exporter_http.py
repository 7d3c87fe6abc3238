"""The /metrics endpoint as scrapers and users meet it: the port is free again right after a run
that was scraped exits, a port in use still fails, OpenMetrics is negotiated like prometheus_client
does, and the runbook the alerts link to by default is served."""

from __future__ import annotations

import gzip
import re
import socket

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import rlwatch
from rlwatch.runs import resources
from rlwatch.alerts import render
from rlwatch.alerts.catalogue import ALERTS
from rlwatch.core.errors import PortInUseError
from rlwatch.exporters.http import MetricsServer

from tests.conftest import make_step


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

    def samples(raw: bytes) -> list[str]:
        return sorted(line for line in raw.decode().splitlines() if line and not line.startswith("#"))

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
    from rlwatch.runs.stack import StackConfig, write_configs

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


@pytest.fixture(scope="module")
def full_endpoint():
    """Every kind of family: the golden steps (alerts, a counted error, scalars, per-environment)."""
    from tests.test_exposition_golden import _steps

    with rlwatch.Watch(run="strict", port=0, store=None, alerts=True, group_size=4) as watch:
        for step, fields in _steps():
            watch.observe(step, **fields)
            watch.log_scalars(step, {"loss": 1.0 / (step + 1)})
        yield watch


def test_no_gauge_shares_a_family_name_with_a_counter():
    from rlwatch.core.metrics import CATALOGUE, RENAMED

    families = [s.full_name[:-len("_total")] if s.kind == "counter" else s.full_name for s in CATALOGUE]
    assert len(families) == len(set(families)), sorted(f for f in families if families.count(f) > 1)
    assert {f"rlwatch_{old}" for old in RENAMED}.isdisjoint({s.full_name for s in CATALOGUE if s.kind != "counter"})


def test_both_formats_pass_strict_parsers_and_promtool(full_endpoint):
    """prometheus_client's own parsers (text and the strict OpenMetrics one) read every family of
    either format; promtool finds nothing in the text format, and in OpenMetrics nothing but the
    counters' samples, which its text-format linter reads as families without help (it does not
    know OpenMetrics' counter naming: family ``x``, samples ``x_total``)."""
    import subprocess

    from prometheus_client.parser import text_string_to_metric_families as text_families

    from tests.conftest import need_binary

    promtool = need_binary("promtool")
    _, text = scrape_raw(full_endpoint.port)
    _, openmetrics = scrape_raw(full_endpoint.port, accept="application/openmetrics-text; version=1.0.0")
    assert openmetrics.endswith(b"# EOF\n")
    text_types = {f.name: f.type for f in text_families(text.decode())}
    om = list(text_string_to_metric_families(openmetrics.decode()))
    assert len(om) > 80 and {f.name: f.type for f in om} == text_types       # each family once, same types
    counters = {f.name for f in om if f.type == "counter"}
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    result = subprocess.run([promtool, "check", "metrics"], input=openmetrics, capture_output=True)
    problems = set((result.stdout + result.stderr).decode().splitlines())
    assert problems == {f"{name}_total no help text" for name in counters}, problems


def request(port: int, path: str, accept: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one GET over a plain socket."""
    head = f"Accept: {accept}\r\n" if accept else ""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{head}\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return int(status.split()[1]), {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}, body


def test_quoted_accept_parameters_negotiate_like_unquoted_ones(endpoint):
    """``version="1.0.0"`` is the same parameter as ``version=1.0.0`` (RFC 9110 quoted-string): no 500,
    no hook error; q-values decide between the formats, unknown OpenMetrics versions fall back to text."""
    errors_before = endpoint.errors.total()
    for accept, expected in (('application/openmetrics-text; version="1.0.0"', "openmetrics"),
                             ('application/openmetrics-text;version="0.0.1";q="0.9",text/plain;q=0.5', "openmetrics"),
                             ('text/plain;q=1,application/openmetrics-text;version=1.0.0;q=0.5', "text"),
                             ('application/openmetrics-text; version="9.9.9", text/plain; version="0.0.4"', "text"),
                             ('application/openmetrics-text; version="1.0.0"; q=abc, */*;q=0.1', "text"),
                             ('application/openmetrics-text; charset="utf,8"; version=1.0.0', "openmetrics"),
                             ('"broken, application/json', "text")):
        status, headers, body = request(endpoint.port, "/metrics", accept)
        assert status == 200, (accept, body[:200])
        assert headers["content-type"].startswith("application/openmetrics-text" if expected == "openmetrics"
                                                  else "text/plain; version=0.0.4"), accept
        assert body.endswith(b"# EOF\n") == (expected == "openmetrics")
    assert endpoint.errors.total() == errors_before


def test_the_exposition_cache_holds_one_body_per_format_whatever_the_headers(endpoint):
    for i in range(300):
        version = f"1.0.{i}" if i % 2 else "1.0.0"
        endpoint.exposition.render(f"application/openmetrics-text; version={version}; x{i}=y, text/plain;q=0.{i % 9}")
        endpoint.exposition.render(f"text/plain; version=1.0.{i}")
    assert len(endpoint.exposition._cached) <= 2


def test_unknown_paths_are_404_and_the_index_page_is_for_a_person():
    with rlwatch.Watch(run='<script>alert("x")</script>', port=0, store=None, alerts=True,
                       alert_overrides={"kl_k3_max": 1e-6}) as watch:
        for step in range(4):
            watch.observe(step, **make_step(seed=step))
        assert watch.evaluator.firing()
        for path in ("/nothing", "/metricsx", "/favicon.ico", "/metrics/../x", "/runbook/x"):
            status, _, body = request(watch.port, path)
            assert status == 404 and b"rlwatch_" not in body, path
        status, headers, page = request(watch.port, "/")
        assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
        page = page.decode()
        assert "<script>" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
        assert "step 3" in page and "RLWatchKLSpike" in page and "(critical)" in page
        assert f'href="http://127.0.0.1:{watch.port}/runbook#rlwatchklspike"' in page
        assert 'href="/metrics"' in page and 'href="/runbook"' in page and "rlwatch_steps_total" not in page
    with rlwatch.Watch(run="quiet", port=0, store=None, alerts=False) as watch:
        page = request(watch.port, "/")[2].decode()
        assert "no step observed yet" in page and "Not evaluated in this process" in page


def test_the_runbook_page_renders_whole_list_items_and_no_repeated_condition_note(endpoint):
    page = request(endpoint.port, "/runbook")[2].decode()
    policy = page.split('id="paging-policy"')[1].split("<h2")[0]
    items = re.findall(r"<li>(.*?)</li>", policy)
    from rlwatch.alerts.policy import PAGING_POLICY

    bullets = PAGING_POLICY.count("\n- ")
    assert bullets >= 6 and len(items) == bullets and all(item.endswith(".") for item in items), items
    assert "<p>magnitude" not in policy and "<p>  " not in page
    for alert in ALERTS:
        section = page.split(f'id="{alert.name.lower()}"')[1].split("<h2")[0]
        condition = re.search(r"<strong>Condition\.</strong> (.*?)</p>", section).group(1)
        note = re.search(r"\(([^()]*)\.\)$", condition)
        assert note is None or note.group(1).split(";")[0] not in condition[:note.start()], condition


def test_alert_links_point_at_the_runbook_this_process_serves(monkeypatch):
    """The port actually bound (port=0, or a fallback), in the events, the notifiers' view, the store
    and the index page; the configured runbook URL wins when set."""
    events = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with rlwatch.Watch(run="links", port=taken.getsockname()[1], port_fallback=True, store=None, alerts=True,
                           alert_overrides={"kl_k3_max": 1e-6}) as watch:
            watch.on_alert(events.append)
            for step in range(3):
                watch.observe(step, **make_step(seed=step))
            assert watch.port != taken.getsockname()[1]
            url = f"http://127.0.0.1:{watch.port}/runbook#rlwatchklspike"
            assert events and {e.runbook_url for e in events} == {url}
            status, _, page = request(watch.port, "/runbook")
            assert status == 200 and 'id="rlwatchklspike"' in page.decode()
    monkeypatch.setenv("RLWATCH_RUNBOOK_URL", "https://wiki.example/rl/runbook")
    with rlwatch.Watch(run="links2", port=0, store=None, alerts=True, alert_overrides={"kl_k3_max": 1e-6}) as watch:
        for step in range(3):
            watch.observe(step, **make_step(seed=step))
        assert {e.runbook_url for e in watch.evaluator.events} == {"https://wiki.example/rl/runbook#rlwatchklspike"}
