"""Faults around the hook: a full or read-only store, an unusable store path, a hanging OTLP
receiver. Training continues, the loss is bounded and reported, the store keeps what completed."""

from __future__ import annotations

import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

import rlwatch
from rlwatch.runs.store import StoreReader

from tests.conftest import TrickleHandler, make_step, observe_timed


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
        assert f'rlwatch_store_dropped_steps_total{{run="f",run_instance="{watch.run_instance}"}} 5.0' in text
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
            durations = observe_timed(watch)
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
        durations = observe_timed(watch)
        body = urllib.request.urlopen(watch.url, timeout=5).read().decode()
        assert f'rlwatch_steps_total{{run="hang",run_instance="{watch.run_instance}"}} 20.0' in body
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


# --- issue 16: the adversarial review ----------------------------------------------------------------

def _scrape(url: str, **kwargs) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5, **kwargs) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_unencodable_strings_never_break_the_exposition_nor_the_store(tmp_path):
    """A lone surrogate (json.loads('"\\udcff"'), os.fsdecode(b"\\xff")) in every string field that
    reaches a label, the store or a notifier: every scrape stays 200 and parseable, the step is
    stored, the strings are escaped, and nothing is counted as an exposition failure."""
    from prometheus_client.parser import text_string_to_metric_families

    bad = "bad\udcff"
    path = str(tmp_path / "s.db")
    with rlwatch.Watch(run="run" + os.fsdecode(b"\xff"), port=0, store=path, framework=bad,
                       metadata={"note": bad}) as watch:
        step = make_step(B=4, T=8)
        step.update(env=["math", bad, "math", bad], failed=[None, bad, None, "x\udc80"],
                    hacked={"det\udcff": torch.tensor([True, False, False, True])}, logprobs_mode=bad)
        assert watch.observe(0, **step) is not None
        watch.log_scalars(0, {"loss\udcff": 1.0})
        watch.note("note\udcff", "detail\udcff")
        watch.record_checkpoint(0, os.fsdecode(b"/tmp/ckpt-\xff"))
        for _ in range(3):
            status, text = _scrape(watch.url)
            assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        envs = {s.labels["env"] for s in families["rlwatch_env_episodes"].samples}
        assert envs == {"math", "bad\\udcff"}
        assert ("export", "exposition") not in watch.errors.counts
        assert watch.flush()
        assert watch.store.dropped == 0
    with StoreReader(path) as store:
        run = store.runs()[0]
        assert run == "run\\udcff"
        assert [r.step for r in store.steps(run)] == [0]
        assert store.checkpoints(run) == [(0, "/tmp/ckpt-\\xff")]
        assert any(e["kind"] == "note\\udcff" for e in store.events(run))


def test_a_family_that_cannot_render_is_counted_and_the_rest_still_served():
    """Defence in depth: a value that bypassed the boundary (written into the state directly) costs
    its family, counted in rlwatch_hook_errors_total{stage="export",kind="exposition"}, never a 500."""
    with rlwatch.Watch(run="x", port=0, store=None, alerts=False) as watch:
        watch.observe(0, **make_step())
        watch.state.set_gauge("framework_metric", 1.0, ("raw\udcff",))
        for _ in range(2):
            status, text = _scrape(watch.url)
            assert status == 200
            assert f'rlwatch_steps_total{{run="x",run_instance="{watch.run_instance}"}} 1.0' in text
            assert (f'rlwatch_hook_errors_total{{kind="exposition",run="x",run_instance="{watch.run_instance}",'
                    'stage="export"}') in text
        assert watch.errors.counts[("export", "exposition")] >= 1


def test_a_family_that_cannot_render_in_openmetrics_leaves_one_eof_at_the_end():
    """The per-family fallback in the OpenMetrics format: the families that render, then one ``# EOF``
    (prometheus_client's strict parser reads the page)."""
    import urllib.request

    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    with rlwatch.Watch(run="x", port=0, store=None, alerts=False) as watch:
        watch.observe(0, **make_step())
        watch.state.set_gauge("framework_metric", 1.0, ("raw\udcff",))
        request = urllib.request.Request(watch.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/openmetrics-text")
            text = resp.read().decode()
        assert text.count("# EOF") == 1 and text.endswith("# EOF\n")
        assert f'rlwatch_steps_total{{run="x",run_instance="{watch.run_instance}"}} 1.0' in text
        families = {f.name for f in text_string_to_metric_families(
            "".join(line + "\n" for line in text.splitlines() if line.startswith(("rlwatch_steps", "# EOF",
                                                                                 "# TYPE rlwatch_steps",
                                                                                 "# HELP rlwatch_steps"))))}
        assert "rlwatch_steps" in families
        assert watch.errors.counts[("export", "exposition")] >= 1


def test_a_row_the_store_refuses_costs_that_row_only(tmp_path):
    """Episodes whose reward is a 0-d tensor (converted at the boundary), and a step the database
    itself refuses (a trigger standing in for any per-row failure): every other step of the same
    write batch is stored, the refused one is counted and noted."""
    import sqlite3

    from rlwatch.hacks import Detector

    path = str(tmp_path / "s.db")
    flag_all = Detector("flag_all", lambda ep: (True, "flagged"))
    with rlwatch.Watch(run="rows", port=None, store=path, alerts=False, hack_detectors=[flag_all]) as watch:
        watch.flush()
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON steps WHEN NEW.step = 7 "
                         "BEGIN SELECT RAISE(ABORT, 'refused'); END")
        step = make_step(B=4, T=8)
        for i in range(40):
            episodes = [dict(prompt="p", response="r", reward=torch.tensor(1.0)) for _ in range(4)]
            watch.observe(i, episodes=episodes, **step)
            watch.record_checkpoint(i, torch.tensor(i).__repr__())          # an odd object: stored as text
        watch.hacks.flush(10)
        watch.observe(40, **step)                                          # exports the last verdicts
        assert watch.flush()
        assert watch.store.dropped == 1
    with StoreReader(path) as store:
        assert [r.step for r in store.steps("rows")] == [i for i in range(41) if i != 7]
        examples = store.hack_examples("rows")
        assert examples and all(e["reward"] == 1.0 for e in examples)
        dropped = [e for e in store.events("rows") if e["kind"] == "store_row_dropped"]
        assert len(dropped) == 1 and "step 7" in dropped[0]["detail"] and "refused" in dropped[0]["detail"]


def test_a_database_locked_by_another_connection_loses_no_step(tmp_path):
    """Another connection holds the write lock for 3 s (longer than the store's busy timeout): the
    writer retries with backoff, observe never waits, and every step arrives."""
    import sqlite3

    path = str(tmp_path / "s.db")
    with rlwatch.Watch(run="locked", port=None, store=path, alerts=False) as watch:
        _pragma(watch, "PRAGMA busy_timeout = 100")         # 0.1 s instead of 5 s: a short test
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        step = make_step(B=4, T=8)
        slowest = 0.0
        deadline = time.monotonic() + 3.0
        observed = 0
        while time.monotonic() < deadline:
            start = time.perf_counter()
            watch.observe(observed, **step)
            slowest = max(slowest, time.perf_counter() - start)
            observed += 1
            time.sleep(0.02)
        holder.execute("COMMIT")
        holder.close()
        assert watch.flush(20)
        assert watch.store.dropped == 0
        assert watch.store.retries >= 1
    assert slowest < 0.5
    with StoreReader(path) as store:
        assert [r.step for r in store.steps("locked")] == list(range(observed))


def test_re_observed_steps_keep_their_history_and_are_counted(tmp_path):
    """Steps 0-9, then a resumed run (a new process: a new attempt) observing 5-14: readers see one
    row per step, the latest; the five earlier rows are kept in step_history; conflicts counted,
    exported and noted."""
    import urllib.request

    path = str(tmp_path / "s.db")
    with rlwatch.Watch(run="resume", port=None, store=path, alerts=False) as first:
        for i in range(10):
            first.observe(i, **make_step(seed=i))
    with rlwatch.Watch(run="resume", port=0, store=path, alerts=False) as second:
        for i in range(5, 15):
            second.observe(i, **make_step(seed=100 + i))
        assert second.flush()
        assert second.store.step_conflicts == 5
        body = urllib.request.urlopen(second.url, timeout=5).read().decode()
        assert f'rlwatch_store_step_conflicts_total{{run="resume",run_instance="{second.run_instance}"}} 5.0' in body
    with StoreReader(path) as store:
        rows = store.steps("resume")
        history = store.step_history("resume")
        attempts = store.attempts("resume")
        events = store.events("resume")
    assert [r.step for r in rows] == list(range(15))
    assert len(attempts) == 2
    assert sorted(r.step for r, _, _ in history) == [5, 6, 7, 8, 9]
    assert {a for _, a, _ in history} == {attempts[0]["id"]}
    tokens = {r.step: r.get("tokens") for r in rows}
    assert tokens[7] == make_step(seed=107)["mask"].sum().item()                     # the latest wins
    assert {r.step: r.get("tokens") for r, _, _ in history}[7] == make_step(seed=7)["mask"].sum().item()
    assert any(e["kind"] == "step_conflict" for e in events)
    assert any(e["kind"] == "step_conflicts" and e["detail"].startswith("5 steps") for e in events)


def test_two_processes_writing_the_same_run_lose_no_step(tmp_path):
    """Two writers (two connections, as two processes have) on one run and one file, interleaved:
    every observation is kept, in steps or in step_history, and the conflicts are counted."""
    path = str(tmp_path / "s.db")
    a = rlwatch.Watch(run="twice", port=None, store=path, alerts=False)
    b = rlwatch.Watch(run="twice", port=None, store=path, alerts=False)
    step = make_step(B=4, T=8)
    for i in range(150):
        a.observe(i, **step)
        b.observe(i, **step)
    a.close()
    b.close()
    with StoreReader(path) as store:
        rows = store.steps("twice")
        history = store.step_history("twice")
    assert len(rows) == 150 and len(history) == 150
    assert a.store.step_conflicts + b.store.step_conflicts == 150
    assert a.store.dropped == b.store.dropped == 0


def test_slack_text_from_a_run_is_inert():
    """<!channel>, <url|text> links and control characters in a label reach Slack escaped."""
    from rlwatch.alerts.notify import AlertEvent, SlackNotifier

    event = AlertEvent("RLWatchKLSpike", "critical", "firing", "run", 3, {"env": "<!channel>"}, 0.5, "summary",
                       "KL spike in env <!channel> <https://evil.example|click> & \x1b]8;;x\x07 \udcff",
                       "https://example.com/runbook#kl")
    text = SlackNotifier.text([event])
    assert "<!channel>" not in text and "<https://evil" not in text and "\x1b" not in text and "\x07" not in text
    assert "&lt;!channel&gt;" in text and "&lt;https://evil.example|click&gt; &amp;" in text
    assert text.endswith("<https://example.com/runbook#kl|runbook>")
    text.encode("utf-8")                                   # sendable


def test_console_alert_lines_escape_control_characters(caplog):
    """An ESC sequence or a newline in a label does not reach the trainer's terminal raw."""
    import logging

    from rlwatch.alerts.notify import AlertEvent, log_event

    caplog.set_level(logging.INFO, logger="rlwatch")
    log_event(AlertEvent("A", "warning", "firing", "run", 1, {"env": "x\x1b]8;;http://e\x07y\nFAKE LINE"}, 1.0,
                         "s", "d", "u"))
    line = caplog.records[-1].getMessage()
    assert "\x1b" not in line and "\x07" not in line and "\n" not in line
    assert "x\\x1b]8;;http://e\\x07y\\x0aFAKE LINE" in line
    log_event(AlertEvent("A", "warning", "firing", "run\x1b[2J\rOK\nFAKE", 1, {}, 1.0, "s", "d", "u"))
    line = caplog.records[-1].getMessage()                 # the run name too (Watch(run=...) is user text)
    assert "\x1b" not in line and "\r" not in line and "\n" not in line
    assert "run=run\\x1b[2J\\x0dOK\\x0aFAKE" in line


def test_pushgateway_credentials_never_reach_logs_or_errors(caplog):
    """A Pushgateway URL with user:password and a token: failed pushes are counted, and neither the
    password nor the token appears in any log line."""
    import logging
    import socket

    with socket.socket() as s:                            # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://pushuser:hunter2-secret@127.0.0.1:{port}/gw/TOKEN-abc123?key=QUERY-xyz"
    caplog.set_level(logging.DEBUG, logger="rlwatch")
    with rlwatch.Watch(run="pg", port=None, store=None, alerts=False, pushgateway=url, push_interval=0.05) as watch:
        watch.observe(0, **make_step())
        time.sleep(0.3)
    assert watch.errors.counts[("export", "push")] >= 1
    logged = "\n".join(r.getMessage() + str(r.exc_info or "") for r in caplog.records)
    assert "127.0.0.1" in logged
    for secret in ("hunter2-secret", "pushuser", "TOKEN-abc123", "QUERY-xyz"):
        assert secret not in logged, logged


def test_pushgateway_credentials_in_the_url_are_sent_as_basic_auth(pushgateway):
    url = pushgateway.url.replace("http://", "http://pushuser:hunter2@")
    with rlwatch.Watch(run="pgauth", port=None, store=None, alerts=False, pushgateway=url) as watch:
        watch.observe(0, **make_step())
        assert watch.push.gateway == pushgateway.url.rstrip("/") or watch.push.gateway == pushgateway.url
    assert watch.push.pushes >= 1 and ("export", "push") not in watch.errors.counts


class _Trickle(TrickleHandler):
    """A receiver that reads the request, then answers one byte every 0.2 s."""

    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Slow: " + b"x" * 200 + b"\r\n\r\n"


def test_a_trickling_webhook_receiver_is_cut_off_at_the_request_timeout():
    """The timeout bounds the whole request, not each socket read: a receiver sending a byte every
    0.2 s costs about one timeout per notification, and the dispatcher closes promptly."""
    from http.server import ThreadingHTTPServer

    from rlwatch.alerts.notify import AlertEvent, Dispatcher, NotifyError, WebhookNotifier

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook/SECRET"
    try:
        notifier = WebhookNotifier(url, timeout=1.0)
        event = AlertEvent("A", "warning", "firing", "run", 1, {}, 1.0, "s", "d", "u")
        start = time.perf_counter()
        with pytest.raises(NotifyError) as info:
            notifier.send([event])
        assert time.perf_counter() - start < 2.0
        assert "SECRET" not in str(info.value)
        errors = []
        dispatcher = Dispatcher([notifier], lambda kind, msg: errors.append(kind))
        dispatcher.submit(event)
        time.sleep(0.1)
        start = time.perf_counter()
        dispatcher.close(timeout=10)
        assert time.perf_counter() - start < 2.0
        assert errors == ["send"]
    finally:
        server.shutdown()


def test_a_store_from_before_step_history_is_migrated_in_place(tmp_path):
    """An existing store (steps without the attempt column, no step_history) is resumed: its row
    for step 0 moves to step_history, readers see one row per step."""
    import sqlite3

    path = str(tmp_path / "old.db")
    with sqlite3.connect(path) as conn:
        conn.executescript("CREATE TABLE steps (run TEXT NOT NULL, step INTEGER NOT NULL, time REAL, data TEXT, "
                           "PRIMARY KEY (run, step)); INSERT INTO steps VALUES ('old', 0, 1.0, '{}');")
    with StoreReader(path) as store:
        assert [r.step for r in store.steps("old")] == [0] and store.step_history("old") == []
    with rlwatch.Watch(run="old", port=None, store=path, alerts=False) as watch:
        watch.observe(0, **make_step())
        watch.observe(1, **make_step())
    with StoreReader(path) as store:
        assert [r.step for r in store.steps("old")] == [0, 1]
        assert [(r.step, attempt) for r, attempt, _ in store.step_history("old")] == [(0, None)]
        assert store.steps("old")[0].get("steps_total") == 1.0
