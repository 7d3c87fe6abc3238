"""`rlwatch postmortem --prometheus`: a server that answers badly ends in one line and rc 1 within the
deadline (issue 27, item 11); a run name exported by several processes is read for the one the user
names, or stops with one line listing them (issue 25, item 2); a fresh run is found and read at every
scrape with default flags (issue 28, item 4)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

import rlwatch
from rlwatch.alerts import render
from rlwatch.postmortem import load, prometheus

from tests.conftest import free_port, make_step, need_binary, start_process

NOW = time.time()
STEP_SERIES = {"metric": {"run": "x", "instance": "h:1", "job": "j"}, "values": [[NOW - 60, "3"], [NOW - 30, "4"]]}


@pytest.fixture
def inproc(capsys):
    """`rlwatch postmortem ARGS` in this process: (rc, stdout, stderr)."""
    from rlwatch.ops.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(["postmortem", *args])
        return (rc, *capsys.readouterr())
    return run


def matrix(*series) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": list(series)}}).encode()


# (status, body) for the first query (the count over the lookback) and for every later one (raw reads)
BAD_ANSWERS = {
    "values missing": ((200, matrix({"metric": {"run": "x"}})), None),
    "values not a list": ((200, matrix({"metric": {"run": "x"}, "values": "1,2"})), None),
    "metric not an object": ((200, matrix({"metric": ["run"], "values": []})), None),
    "label value not a string": ((200, matrix({"metric": {"run": 1}, "values": []})), None),
    "value not a number": ((200, matrix(STEP_SERIES)), (200, matrix({"metric": {}, "values": [[NOW, "many"]]}))),
    "timestamp not a number": ((200, matrix(STEP_SERIES)), (200, matrix({"metric": {}, "values": [["now", "1"]]}))),
    "sample not a pair": ((200, matrix(STEP_SERIES)), (200, matrix({"metric": {}, "values": [[NOW]]}))),
    "no data": ((200, b'{"status": "success"}'), None),
    "result not a list": ((200, b'{"status": "success", "data": {"resultType": "matrix", "result": {}}}'), None),
    "a vector, not a matrix": ((200, b'{"status": "success", "data": {"resultType": "vector", "result": []}}'), None),
    "status error": ((200, b'{"status": "error", "error": "boom"}'), None),
    "an array": ((200, b"[1, 2, 3]"), None),
    "200,000-deep JSON": ((200, b"[" * 200_000 + b"]" * 200_000), None),
    "deep JSON later": ((200, matrix(STEP_SERIES)), (200, b'{"a":' * 200_000 + b"1" + b"}" * 200_000)),
    "not JSON": ((200, b"<html>I am not Prometheus</html>"), None),
    "HTTP 500": ((500, b"internal error"), None),
    "HTTP 400 with Prometheus' error": ((400, b'{"status":"error","errorType":"bad_data","error":"parse error"}'),
                                        None),
    "HTTP 503 later": ((200, matrix(STEP_SERIES)), (503, b"")),
}


class Misbehaving(BaseHTTPRequestHandler):
    """A Prometheus stand-in that answers as ``server.answers`` says, or trickles one byte a second."""

    def do_GET(self):  # noqa: N802
        query = parse_qs(urlsplit(self.path).query)
        first, later = self.server.answers
        mode = self.server.mode
        if mode == "trickle headers":
            self._trickle(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 600)
            return
        status, body = first if "count_over_time" in query.get("query", [""])[0] or later is None else later
        if mode == "trickle body" and later is None:
            self.send_response(200)
            self.send_header("Content-Length", "600")
            self.end_headers()
            self._trickle(b" " * 600)
            return
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self, data: bytes) -> None:
        for i in range(len(data)):
            try:
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
            except OSError:             # the client gave up: stop
                return
            time.sleep(1.0)

    def log_message(self, *args):
        pass


@pytest.fixture
def bad_prometheus():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.daemon_threads = True
    server.answers, server.mode = (None, None), None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.mark.parametrize("case", [*BAD_ANSWERS, "trickle body", "trickle headers"])
def test_a_prometheus_answering_badly_is_one_line_and_rc_1_within_the_deadline(case, bad_prometheus, inproc):
    if case in BAD_ANSWERS:
        bad_prometheus.answers = BAD_ANSWERS[case]
    else:
        bad_prometheus.answers, bad_prometheus.mode = ((200, b""), None), case
    url = f"http://127.0.0.1:{bad_prometheus.server_address[1]}"
    start = time.monotonic()
    rc, out, err = inproc("--prometheus", url, "--run", "x", "--deadline", "3")
    elapsed = time.monotonic() - start
    assert rc == 1, (case, out, err)
    assert err.startswith("rlwatch postmortem: ") and err.count("\n") == 1, (case, err)
    assert f"Prometheus at {url}" in err, (case, err)
    assert elapsed < 3 + 2, (case, elapsed)
    if case.startswith("trickle"):
        assert "3 s deadline" in err
    if case == "HTTP 400 with Prometheus' error":
        assert "parse error" in err


def test_the_deadline_must_be_positive(inproc):
    for value in ("0", "-1", "nan"):
        rc, _, err = inproc("--prometheus", "http://127.0.0.1:1", "--run", "x", "--deadline", value)
        assert rc == 1 and "--deadline must be a positive number" in err, err
    rc, _, err = inproc("--prometheus", "file:///etc/passwd", "--run", "x")
    assert rc == 1 and "not an http:// or https:// URL" in err, err


# --- a real Prometheus: one run name, three processes ---------------------------------------------------

STEPS = 30
#: Each process of run "twin": whether its series carry ``run_instance`` (False: an exporter from
#: before the label, told apart by Prometheus' ``instance``), the step its reward collapses at and
#: the step its k3 rises at.
TWINS = {"a": (True, 18, 15), "b": (True, None, None), "c": (False, 8, 5)}


def twin_step(step: int, collapse: int | None, spike: int | None) -> dict:
    rec = make_step(B=8, T=8, seed=step, lag_max=0, noise=0.8 if spike is not None and step >= spike else 0.02)
    rec["rewards"] = torch.full((8,), 0.0 if collapse is not None and step >= collapse else 1.0)
    return rec


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Prometheus scraping three Watches of run "twin" every 250 ms (c's ``run_instance`` label
    dropped at scrape time, as an older exporter lacks it), with a rule that fires on k3 > 0.1;
    30 steps every 0.5 s. Yields (Prometheus URL, {process: its run_instance or instance label})."""
    binary = need_binary("prometheus")
    tmp = tmp_path_factory.mktemp("twins")
    ports = {name: free_port() for name in TWINS}
    prom_port = free_port()
    (tmp / "rules.yml").write_text(render.to_yaml({"groups": [{"name": "t", "interval": "250ms", "rules": [
        {"alert": "TestKLHigh", "expr": "rlwatch_mismatch_kl_k3 > 0.1", "labels": {"severity": "critical"}}]}]}))
    jobs = [{"job_name": name, "honor_labels": True, "static_configs": [{"targets": [f"127.0.0.1:{ports[name]}"]}],
             **({} if labelled else {"metric_relabel_configs": [{"action": "labeldrop", "regex": "run_instance"}]})}
            for name, (labelled, _, _) in TWINS.items()]
    (tmp / "prometheus.yml").write_text(render.to_yaml({
        "global": {"scrape_interval": "250ms", "evaluation_interval": "250ms"},
        "rule_files": [str(tmp / "rules.yml")], "scrape_configs": jobs}))
    prom = start_process([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                          f"--web.listen-address=127.0.0.1:{prom_port}"], prom_port, tmp / "prom.log")
    watches = {name: rlwatch.Watch(run="twin", port=ports[name], store=None, alerts=False) for name in TWINS}
    try:
        deadline = time.time() + 30
        import urllib.request

        while time.time() < deadline:          # every target scraped before the first step
            body = json.loads(urllib.request.urlopen(prom.url + "/api/v1/query?query=sum(up)", timeout=5).read())
            if body["data"]["result"] and body["data"]["result"][0]["value"][1] == "3":
                break
            time.sleep(0.2)
        for step in range(STEPS):
            for name, (_, collapse, spike) in TWINS.items():
                watches[name].observe(step, **twin_step(step, collapse, spike))
            time.sleep(0.5)
        time.sleep(1.0)
        yield prom.url, {name: watches[name].state.run_instance if labelled else f"127.0.0.1:{ports[name]}"
                         for name, (labelled, _, _) in TWINS.items()}
    finally:
        for watch in watches.values():
            watch.close()
        prom.stop()


def test_several_processes_of_one_run_name_stop_with_one_line_listing_them(twins, inproc):
    url, instance = twins
    rc, out, err = inproc("--prometheus", url, "--run", "twin")
    assert rc == 1 and err.count("\n") == 1, err
    assert "3 processes exported run 'twin'; name one with --run-instance" in err
    for name in TWINS:
        assert f"{instance[name]} (steps 0..{STEPS - 1}, " in err, err
    rc, out, err = inproc("--prometheus", url, "--run", "twin", "--run-instance", "nope")
    assert rc == 1 and "no single instance 'nope'" in err and f"{instance['a']} (steps 0.." in err, err


@pytest.mark.parametrize("name", list(TWINS))
def test_the_named_process_is_read_alone_at_every_scrape_with_default_flags(twins, name, inproc):
    url, instance = twins
    labelled, collapse, spike = TWINS[name]
    rc, out, err = inproc("--prometheus", url, "--run", "twin", "--run-instance", instance[name], "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["steps"] == [0, STEPS - 1]            # found without --since, not one point of a 60 s grid
    if collapse is None:
        assert doc["collapse_step"] is None and doc["alerts"] == []
    else:
        assert collapse <= doc["collapse_step"] <= collapse + 1, doc["collapse_step"]
        alerts = [(a["name"], a["step"], a["labels"].get("run_instance" if labelled else "instance"))
                  for a in doc["alerts"]]
        assert alerts == [("TestKLHigh", alerts[0][1], instance[name])] and spike <= alerts[0][1] <= spike + 2, alerts


def test_chunked_reads_give_the_same_run(twins, monkeypatch):
    url, instance = twins
    whole = load(prometheus=url, run="twin", run_instance=instance["a"])
    assert len(whole.steps) >= STEPS - 3                    # a step every 0.5 s, a scrape every 0.25 s
    monkeypatch.setattr(prometheus, "CHUNK_SCRAPES", 7)
    chunked = load(prometheus=url, run="twin", run_instance=instance["a"], lookback_seconds=300)     # windows of 1 s
    assert chunked.steps == whole.steps and chunked.alerts == whole.alerts and chunked.scalars == whole.scalars
