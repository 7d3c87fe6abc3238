"""Prometheus export: a collector over the run's snapshot, the exporter's pages, and a push mode.

The collector yields every family of :data:`rlwatch.core.metrics.CATALOGUE` from one
:class:`~rlwatch.core.state.Snapshot`, so a scrape reads one consistent step and computes nothing.
:class:`CachedExposition` is the WSGI app the endpoint (:mod:`rlwatch.exporters.http`) serves:
``/metrics`` in the Prometheus text format or in OpenMetrics, as the scraper's ``Accept`` header
asks; ``/`` a page for a person (:mod:`rlwatch.exporters.landing`); the runbook shipped with the package
at ``/runbook`` (HTML, one anchor per alert: where the alerts' ``runbook_url`` points) and
``/runbook.md``; 404 elsewhere.
"""

from __future__ import annotations

import gzip
import logging
import re
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from ..core.metrics import CATALOGUE, HISTOGRAM_BUCKETS, MetricSpec
from ..core.state import MetricState

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
        held = {"gauge": snap.gauges, "info": snap.info, "counter": snap.counters, "histogram": snap.histograms}
        for spec in exported():
            series = held[spec.kind].get(spec.name)
            if not series:
                continue
            metric = family(spec)
            for label_values, value in sorted(series.items()):
                if spec.kind == "histogram":             # (per-bucket counts, sum) -> cumulative buckets
                    counts, total = value
                    metric.add_metric([*run, *label_values], cumulative(spec.name, counts), sum_value=total)
                else:
                    metric.add_metric([*run, *label_values], value)
            yield metric

    def describe(self) -> Iterable[Metric]:
        """Every family the collector can yield, empty: a registry reads the names at ``register`` and
        refuses one another collector already yields; two catalogue families that would be exported under
        one name (a gauge ``x`` beside a counter ``x_total`` is one OpenMetrics family) raise here."""
        specs = exported()
        families = [family(spec) for spec in specs]
        owner: dict[str, str] = {}
        for spec, metric in zip(specs, families):
            for name in series_names(metric):
                if name in owner:
                    raise ValueError(f"two catalogue families are exported as {name}: {owner[name]!r} and "
                                     f"{spec.name!r} (rename one in its declaration, or through RENAMED)")
                owner[name] = spec.name
        return families


_FAMILY_TYPES = {"gauge": GaugeMetricFamily, "info": GaugeMetricFamily, "counter": CounterMetricFamily,
                 "histogram": HistogramMetricFamily}
#: The series names a family of each type holds besides its own (prometheus_client's registry reads the same).
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported() -> tuple[MetricSpec, ...]:
    """The catalogue's exported families, in its order (``sample`` entries are kept in the run store only)."""
    return tuple(spec for spec in CATALOGUE if spec.kind in _FAMILY_TYPES)


def family(spec: MetricSpec) -> Metric:
    """An empty family of a catalogue entry, labelled ``run``, ``run_instance`` and its own labels."""
    return _FAMILY_TYPES[spec.kind](spec.full_name, spec.help, labels=["run", "run_instance", *spec.labels])


def series_names(metric: Metric) -> list[str]:
    """The family's name and the series names its type adds (``_total``, ``_bucket``, ...)."""
    return [metric.name, *(metric.name + suffix for suffix in _SUFFIXES.get(metric.type, ()))]


def cumulative(name: str, counts: Iterable[float]) -> list[tuple[str, float]]:
    """Histogram ``name``'s per-bucket counts as Prometheus' cumulative (``le``, count) pairs."""
    out, running = [], 0.0
    for bound, count in zip(HISTOGRAM_BUCKETS[name][1], counts):
        running += count
        out.append((bound, running))
    return out


#: The exposition formats, by name: (encoder, content type).
FORMATS: dict[str, tuple[Callable[[Any], bytes], str]] = {
    "text": (generate_latest, CONTENT_TYPE_PLAIN_0_0_4),
    "openmetrics": (openmetrics.generate_latest, openmetrics.CONTENT_TYPE_LATEST),
}
_OPENMETRICS_VERSIONS = (None, "1.0.0", "0.0.1")
_TEXT_TYPES = ("text/plain", "text/*", "*/*")


#: An Accept (or Accept-Encoding) header is read up to this many characters and ranges: what a
#: scraper or a browser sends is a few hundred characters, and a longer header must not cost the
#: trainer's process more than a normal scrape does.
MAX_ACCEPT_CHARS, MAX_ACCEPT_RANGES = 2048, 64
_MEDIA_TYPES = ("application/openmetrics-text", *_TEXT_TYPES, "gzip")
# one comma- (or semicolon-) separated part, a double-quoted string (RFC 9110, ``\\`` escapes) kept whole
_ITEM = re.compile(r'(?:"(?:[^"\\]|\\[\s\S]?)*"?|[^,"])+')
_PARAM = re.compile(r'(?:"(?:[^"\\]|\\[\s\S]?)*"?|[^;"])+')


def _media_ranges(accept: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """(media type, parameters with quotes removed, q) of each range of an Accept header that names
    one of the types negotiated here, among its first :data:`MAX_ACCEPT_RANGES` ranges and
    :data:`MAX_ACCEPT_CHARS` characters (the regular expressions split it, not a loop per character)."""
    items = _ITEM.findall(accept[:MAX_ACCEPT_CHARS])
    if len(accept) > MAX_ACCEPT_CHARS:
        items = items[:-1]                          # the range cut in the middle is not read
    for item in items[:MAX_ACCEPT_RANGES]:
        media, _, rest = item.partition(";")
        media = media.strip().lower()
        if media not in _MEDIA_TYPES:
            continue
        values = {}
        for param in _PARAM.findall(rest):
            key, _, value = param.partition("=")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            values[key.strip().lower()] = value
        try:
            q = float(values.pop("q", "1"))
        except ValueError:
            q = 0.0
        yield media, values, q if 0.0 <= q <= 1.0 else 0.0


def negotiate(accept: str) -> str:
    """The format (a key of :data:`FORMATS`) for an Accept header: OpenMetrics when the header
    accepts it (version 1.0.0, 0.0.1 or unstated) at least as much as the text format, else text,
    also for a header that names neither or cannot be read."""
    best = {"openmetrics": 0.0, "text": 0.0}
    for media, params, q in _media_ranges(accept or ""):
        if media == "application/openmetrics-text" and params.get("version") in _OPENMETRICS_VERSIONS:
            best["openmetrics"] = max(best["openmetrics"], q)
        elif media in _TEXT_TYPES:
            best["text"] = max(best["text"], q)
    return "openmetrics" if best["openmetrics"] > 0 and best["openmetrics"] >= best["text"] else "text"


def _accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header asks for gzip (``gzip;q=0`` refuses it)."""
    return any(coding == "gzip" and q > 0 for coding, _, q in _media_ranges(header))


class CachedExposition:
    """The exporter's WSGI app. ``/metrics`` serves the registry in the format the scraper's
    ``Accept`` header negotiates (:func:`negotiate`), re-rendered only when the state changed since
    the last scrape in that format (a scrape between two steps costs a copy, not a render; one
    cached body per format, whatever the headers). ``/`` is a page for a person, ``/runbook`` and
    ``/runbook.md`` the packaged runbook; any other path is 404.

    A scrape never fails because of what the run exported: when rendering raises, the error is
    counted through ``on_error`` (``rlwatch_hook_errors_total{stage="export",kind="exposition"}``)
    and the families that still render are served, the failing ones left out."""

    def __init__(self, registry: CollectorRegistry, state: MetricState | None = None,
                 refresh: Callable[[], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 firing: Callable[[], list | None] | None = None) -> None:
        self.registry = registry
        self.state = state
        self.refresh = refresh
        self.on_error = on_error
        self.firing = firing       # the in-process evaluator's firing alerts; None: not evaluated here
        self._lock = threading.Lock()
        # format -> (state version, body, gzip body)
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
        name = negotiate(accept)
        encoder, content_type = FORMATS[name]
        with self._lock:
            if self.refresh is not None:
                self.refresh()
            version = self.state.version if self.state is not None else None
            cached = self._cached.get(name)
            if version is None or cached is None or cached[0] != version:
                _FOLDED.active = self.refresh is not None
                try:
                    text = self._generate(encoder)
                finally:
                    _FOLDED.active = False
                cached = (version if version is not None else -1, text, gzip.compress(text, 5))
                self._cached[name] = cached
        with self._served:
            self.served_version = max(self.served_version, cached[0])
            self.scrape_times.append(time.monotonic())
            self._served.notify_all()
        return cached[1], cached[2], content_type

    def await_scrape(self, version: int, unmeasured: float = 2.0, limit: float = 60.0) -> bool:
        """Wait until a /metrics answer has shown state ``version``: at most 1.5 measured scrape
        intervals plus 1 s and ``limit`` seconds, or ``unmeasured`` seconds when fewer than two scrapes
        were seen (a person or a health probe that fetched once: no scraper to wait for). False at once
        when nothing ever scraped, or when the time ran out."""
        with self._served:
            if not self.scrape_times:
                return False
            times = list(self.scrape_times)
            wait = min(limit, 1.5 * (times[-1] - times[-2]) + 1.0) if len(times) > 1 else min(limit, unmeasured)
            return self._served.wait_for(lambda: self.served_version >= version, timeout=wait)

    def _runbook_page(self, path: str) -> tuple[bytes, str]:
        from ..runs import resources

        if path not in self._runbook:
            self._runbook[path] = (resources.runbook_html() if path == "/runbook"
                                   else resources.runbook_markdown()).encode("utf-8")
        kind = "text/html" if path == "/runbook" else "text/markdown"
        return self._runbook[path], f"{kind}; charset=utf-8"

    def _index_page(self) -> bytes:
        from .landing import index_html

        snap = self.state.snapshot() if self.state is not None else None
        firing = self.firing() if self.firing is not None else None
        return index_html(snap, firing).encode("utf-8")

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
            return [b""]
        headers: list[tuple[str, str]] = []
        if path in ("/runbook", "/runbook/", "/runbook.md"):
            body, content_type = self._runbook_page(path.rstrip("/"))
        elif path == "/":
            body, content_type = self._index_page(), "text/html; charset=utf-8"
            headers.append(("Cache-Control", "no-store"))
        elif path in ("/metrics", "/metrics/"):
            body, compressed, content_type = self.render(environ.get("HTTP_ACCEPT", ""))
            headers.append(("Vary", "Accept, Accept-Encoding"))
            if _accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING", "")):
                headers.append(("Content-Encoding", "gzip"))
                body = compressed
        else:
            body = b"not found: rlwatch serves /metrics, /runbook and / (a summary page)\n"
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                             ("Content-Length", str(len(body)))])
            return [b"" if method == "HEAD" else body]
        start_response("200 OK", [("Content-Type", content_type), *headers, ("Content-Length", str(len(body)))])
        return [b"" if method == "HEAD" else body]


class _OneFamily:
    """A registry-like holder of one collected family (for rendering families one by one)."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self._metric]


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
