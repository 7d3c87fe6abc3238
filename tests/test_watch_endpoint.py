"""Watch's /metrics endpoint: a busy port, TLS and basic auth, idle TLS and plain-HTTP clients that
neither block scrapes nor hang close, and a non-ASCII Authorization header."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest

import rlwatch
from rlwatch import PortInUseError

from .conftest import make_step, self_signed_cert
from ._watch_helpers import scrape


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
