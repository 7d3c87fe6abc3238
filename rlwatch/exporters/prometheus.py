"""Prometheus export: a collector over the run's snapshot, an HTTP endpoint, and a push mode.

The collector yields every family of :data:`rlwatch.metrics.CATALOGUE` from one
:class:`~rlwatch.state.Snapshot`, so a scrape reads one consistent step and computes nothing.
The endpoint binds 127.0.0.1 unless told otherwise, and can serve TLS and HTTP basic auth. It
answers in the Prometheus text format or in OpenMetrics, as the scraper's ``Accept`` header asks
(prometheus_client's negotiation), and serves the runbook shipped with the package at ``/runbook``
(HTML, one anchor per alert: the default target of the alerts' ``runbook_url``) and ``/runbook.md``.
"""

from __future__ import annotations

import base64
import errno
import hmac
import logging
import socket
import ssl
import sys
import threading
import time
from collections import deque
from socketserver import ThreadingMixIn
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric)

from ..errors import PortInUseError
from ..metrics import CATALOGUE
from ..state import MetricState
from . import le_labels

logger = logging.getLogger("rlwatch")

#: Set on a thread while :class:`CachedExposition` renders: it already folded rlwatch's own health
#: into the state for this scrape, so the collector does not fold it a second time.
_FOLDED = threading.local()


class RLWatchCollector:
    """A prometheus_client collector over a :class:`MetricState`."""

    def __init__(self, state: MetricState, extra: Callable[[], None] | None = None) -> None:
        self.state = state
        self._refresh = extra  # folds in hook error totals before each snapshot, unless the scrape already did

    def collect(self) -> Iterable[Metric]:
        if self._refresh is not None and not getattr(_FOLDED, "active", False):
            self._refresh()
        snap = self.state.snapshot()
        run = (snap.run, snap.run_instance)          # the run identity every series carries
        for spec in CATALOGUE:
            labels = ["run", "run_instance", *spec.labels]
            if spec.kind in ("gauge", "info"):
                family = snap.gauges.get(spec.name) if spec.kind == "gauge" else snap.info.get(spec.name)
                if not family:
                    continue
                metric = GaugeMetricFamily(spec.full_name, spec.help, labels=labels, unit="")
                for label_values, value in sorted(family.items()):
                    metric.add_metric([*run, *label_values], value)
                yield metric
            elif spec.kind == "counter":
                family = snap.counters.get(spec.name)
                if not family:
                    continue
                metric = CounterMetricFamily(spec.full_name, spec.help, labels=labels)
                for label_values, value in sorted(family.items()):
                    metric.add_metric([*run, *label_values], value)
                yield metric
            elif spec.kind == "histogram":
                hist = snap.histograms.get(spec.name)
                if hist is None:
                    continue
                counts, total = hist
                cumulative, running = [], 0.0
                for bound, count in zip(le_labels(), counts):
                    running += count
                    cumulative.append((bound, running))
                metric = HistogramMetricFamily(spec.full_name, spec.help, labels=labels)
                metric.add_metric(list(run), cumulative, sum_value=total)
                yield metric


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per connection, at most ``max_connections`` at a time (later connections are
    closed at once: a scraper retries, a flood of idle clients cannot grow the trainer's threads)."""

    daemon_threads = True
    # SO_REUSEADDR, as every HTTP server sets it: the port of a run that just exited (its scraped
    # connections in TIME-WAIT) can be bound again at once. On Linux it never lets two servers share
    # a port that one of them still listens on: a taken port still fails with EADDRINUSE.
    allow_reuse_address = True
    idle_timeout = 10.0           # seconds a connection may stay silent (TLS handshake included)
    max_connections = 64
    on_error: Callable[[str, BaseException], None] | None = None

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that stalls, resets or fails the handshake costs its own connection only;
        nothing is printed to the trainer's stderr."""
        exc = sys.exc_info()[1]
        if self.on_error is not None and exc is not None and not isinstance(exc, (OSError, ssl.SSLError)):
            self.on_error("server", exc)


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        """Bound every read and write of the connection, and run the TLS handshake here, on the
        connection's own thread, rather than in ``accept`` on the server's only thread."""
        self.timeout = self.server.idle_timeout
        self.request.settimeout(self.timeout)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - wsgiref's signature
        pass

    def get_stderr(self) -> "_Discard":
        return _Discard()


class _Discard:
    """wsgi.errors: application errors are counted by :func:`_never_raise`, not printed."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _never_raise(app: Callable, on_error: Callable[[str, BaseException], None] | None) -> Callable:
    """A WSGI app that answers 500 (counted) instead of raising into wsgiref, which would print a
    traceback to the trainer's stderr on every request."""
    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        try:
            return app(environ, start_response)
        except Exception as exc:  # noqa: BLE001
            if on_error is not None:
                on_error("server", exc)
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")], sys.exc_info())
            return [b"internal error\n"]

    return guarded


def _accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header asks for gzip (``gzip;q=0`` refuses it)."""
    for item in header.split(","):
        name, *params = [part.strip() for part in item.split(";")]
        if name.lower() == "gzip":
            for param in params:
                if param.lower().startswith("q="):
                    try:
                        return float(param[2:]) > 0
                    except ValueError:
                        return False
            return True
    return False


class CachedExposition:
    """A WSGI app serving the registry in the format the scraper's ``Accept`` header asks for
    (Prometheus text or OpenMetrics, ``prometheus_client.exposition.choose_encoder``), re-rendered
    only when the state changed since the last scrape in that format (a scrape between two steps
    costs a copy, not a render). ``/runbook`` and ``/runbook.md`` serve the packaged runbook.

    A scrape never fails because of what the run exported: when rendering raises, the error is
    counted through ``on_error`` (``rlwatch_hook_errors_total{stage="export",kind="exposition"}``)
    and the families that still render are served, the failing ones left out."""

    def __init__(self, registry: CollectorRegistry, state: MetricState | None = None,
                 refresh: Callable[[], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.registry = registry
        self.state = state
        self.refresh = refresh
        self.on_error = on_error
        self._lock = threading.Lock()
        # content type -> (state version, body, gzip body)
        self._cached: dict[str, tuple[int, bytes, bytes]] = {}
        self._runbook: dict[str, bytes] = {}
        self._served = threading.Condition()
        self.served_version = -1                   # the state version the latest /metrics answer showed
        self.scrape_times: deque[float] = deque(maxlen=4)      # monotonic times of the latest answers

    def _generate(self, encoder: Callable[[CollectorRegistry], bytes]) -> bytes:
        try:
            return encoder(self.registry)
        except Exception as exc:  # noqa: BLE001 - one bad family must not take /metrics down
            if self.on_error is not None:
                try:
                    self.on_error(exc)
                except Exception:  # noqa: BLE001
                    pass
            if self.refresh is not None:             # the error just counted is served with this scrape
                self.refresh()
        parts = []
        for metric in self.registry.collect():      # family by family: serve all that render
            try:
                parts.append(encoder(_OneFamily(metric)))
            except Exception:  # noqa: BLE001
                continue
        if parts and parts[0].endswith(b"# EOF\n"):  # OpenMetrics: one EOF marker, at the end
            parts = [p[:-len(b"# EOF\n")] for p in parts] + [b"# EOF\n"]
        return b"".join(parts)

    def render(self, accept: str = "") -> tuple[bytes, bytes, str]:
        """(body, gzip body, content type) for an ``Accept`` header."""
        import gzip

        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept)
        with self._lock:
            if self.refresh is not None:
                self.refresh()
            version = self.state.version if self.state is not None else None
            cached = self._cached.get(content_type)
            if version is None or cached is None or cached[0] != version:
                _FOLDED.active = self.refresh is not None
                try:
                    text = self._generate(encoder)
                finally:
                    _FOLDED.active = False
                cached = (version if version is not None else -1, text, gzip.compress(text, 5))
                self._cached[content_type] = cached
        with self._served:
            self.served_version = max(self.served_version, cached[0])
            self.scrape_times.append(time.monotonic())
            self._served.notify_all()
        return cached[1], cached[2], content_type

    def await_scrape(self, version: int, limit: float = 60.0) -> bool:
        """Wait until a /metrics answer has shown state ``version``: at most 1.5 measured scrape
        intervals plus 1 s (``limit`` when fewer than two scrapes were seen; never more). False
        at once when nothing ever scraped, or when the time ran out."""
        with self._served:
            if not self.scrape_times:
                return False
            times = list(self.scrape_times)
            wait = min(limit, 1.5 * (times[-1] - times[-2]) + 1.0) if len(times) > 1 else limit
            return self._served.wait_for(lambda: self.served_version >= version, timeout=wait)

    def _runbook_page(self, path: str) -> tuple[bytes, str]:
        from .. import resources

        if path not in self._runbook:
            self._runbook[path] = (resources.runbook_html() if path == "/runbook"
                                   else resources.runbook_markdown()).encode("utf-8")
        kind = "text/html" if path == "/runbook" else "text/markdown"
        return self._runbook[path], f"{kind}; charset=utf-8"

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/favicon.ico":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b""]
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if path.rstrip("/") in ("/runbook", "/runbook.md"):
            page, content_type = self._runbook_page(path.rstrip("/"))
            start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(page)))])
            return [b"" if method == "HEAD" else page]
        text, compressed, content_type = self.render(environ.get("HTTP_ACCEPT", ""))
        headers = [("Content-Type", content_type), ("Vary", "Accept, Accept-Encoding")]
        body = text
        if _accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING", "")):
            headers.append(("Content-Encoding", "gzip"))
            body = compressed
        headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", headers)
        return [b"" if method == "HEAD" else body]


class _OneFamily:
    """A registry-like holder of one collected family (for rendering families one by one)."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self._metric]


def _with_basic_auth(app: Callable, username: str, password: str) -> Callable:
    expected = base64.b64encode(f"{username}:{password}".encode()).decode().encode("ascii")

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = header.partition(" ")
        # WSGI hands headers over as latin-1 strings: compare bytes (any header, never a TypeError).
        given = token.strip().encode("latin-1", "replace")
        if scheme.lower() != "basic" or not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="rlwatch"'),
                                                ("Content-Type", "text/plain")])
            return [b"unauthorized\n"]
        return app(environ, start_response)

    return guarded


class MetricsServer:
    """``/metrics`` over HTTP(S) on its own daemon threads.

    port=0 picks a free port; with ``port_fallback`` a taken port moves on to the next 32 ports.
    Raises :class:`PortInUseError` when no port could be bound.
    """

    def __init__(self, registry: CollectorRegistry, addr: str = "127.0.0.1", port: int = 9400, *,
                 port_fallback: bool = False, certfile: str | None = None, keyfile: str | None = None,
                 basic_auth: tuple[str, str] | None = None, app: Callable | None = None,
                 idle_timeout: float = 10.0, max_connections: int = 64,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        app = app or make_wsgi_app(registry)
        if basic_auth is not None:
            app = _with_basic_auth(app, *basic_auth)
        app = _never_raise(app, on_error)
        server_class = type("_Server", (_ThreadingServer,), dict(idle_timeout=idle_timeout,
                                                                  max_connections=max_connections,
                                                                  on_error=staticmethod(on_error) if on_error
                                                                  else None))
        candidates = [port] if (port == 0 or not port_fallback) else list(range(port, port + 33))
        last_error: OSError | None = None
        self._server = None
        for candidate in candidates:
            try:
                self._server = make_server(addr, candidate, app, server_class, handler_class=_QuietHandler)
                break
            except OSError as exc:
                last_error = exc
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    break
        if self._server is not None and candidates[0] != self._server.server_address[1] and port:
            reason = last_error.strerror if last_error is not None else "in use"
            logger.warning("rlwatch: cannot serve /metrics on %s:%d (%s: another process listens there); serving on "
                           "port %d instead (port_fallback)", addr, port, reason, self._server.server_address[1])
        if self._server is None:
            raise PortInUseError(
                f"cannot serve /metrics on {addr}:{port}: {last_error}. Pass port=0 for any free port, "
                f"port_fallback=True to try the next ports, or port=None to disable the endpoint.")
        if certfile:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile, keyfile)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        self.addr = addr
        self.port = self._server.server_address[1]
        self.scheme = "https" if certfile else "http"
        self._thread = threading.Thread(target=self._server.serve_forever, name="rlwatch-metrics",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None


class PushLoop:
    """Pushes the registry to a Pushgateway every ``interval`` seconds on a daemon thread, and once
    more on close, for jobs too short to be scraped. Failures are reported, never raised."""

    def __init__(self, registry: CollectorRegistry, gateway: str, job: str, run: str, interval: float,
                 on_error: Callable[[str, BaseException], None], timeout: float = 5.0,
                 run_instance: str = "") -> None:
        from urllib.parse import unquote, urlsplit, urlunsplit

        self.registry = registry
        parts = urlsplit(gateway if "://" in gateway else f"http://{gateway}")
        self._credentials = None
        if parts.username is not None:      # user:password@host: sent as basic auth, never in the URL
            self._credentials = (unquote(parts.username), unquote(parts.password or ""))
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            gateway = urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))
        self.gateway = gateway
        self.job = job
        # One group per process: two processes pushing one run name never replace each other's metrics.
        self.grouping_key = {"run": run, **({"run_instance": run_instance} if run_instance else {})}
        self.interval = interval
        self.timeout = timeout
        self._on_error = on_error
        self.pushes = 0
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="rlwatch-push", daemon=True)
        self._thread.start()

    def push_now(self) -> bool:
        from prometheus_client import push_to_gateway

        extra = {}
        if self._credentials is not None:
            from prometheus_client.exposition import basic_auth_handler

            username, password = self._credentials
            extra["handler"] = lambda url, method, timeout, headers, data: basic_auth_handler(
                url, method, timeout, headers, data, username, password)
        try:
            push_to_gateway(self.gateway, job=self.job, registry=self.registry,
                            grouping_key=self.grouping_key, timeout=self.timeout, **extra)
            self.pushes += 1
            return True
        except Exception as exc:  # noqa: BLE001 - a down gateway must never reach the trainer
            self._on_error("push", exc)
            return False

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            stopping = self._stop            # read before the push: a close() during it gets one more
            self.push_now()
            if stopping:
                break

    def close(self) -> bool:
        """Push a last time; returns False (and leaves it to the daemon thread) when the gateway has
        not answered within about two timeouts, so that a hanging gateway bounds, never blocks, exit."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=2 * self.timeout + 1)
        if self._thread.is_alive():
            self._on_error("push", TimeoutError(f"last push not confirmed within {2 * self.timeout + 1:.0f} s"))
            return False
        return True
