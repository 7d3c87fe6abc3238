"""One run read from a live Prometheus, for the post-mortem.

- **One deadline** for the whole command (:class:`Deadline`): each request waits at most what is
  left, a watchdog shuts its connection at the deadline (a body trickled one byte at a time would
  otherwise restart the per-read timeout with every byte), and reading an answer's samples stops
  when it passes.
- **A size cap**: an answer larger than :data:`MAX_BODY_BYTES` (32 MiB) is refused with one line,
  from its ``Content-Length`` before reading it, else as soon as that much has come; so parsing one
  answer is bounded too (a second or so).
- **Every answer validated**: an error status, a non-JSON or too deeply nested body, a missing key or
  a wrong type ends in one :class:`PostmortemInputError` line, never a traceback.
- **One run instance**: series are told apart by ``run_instance`` (one per Watch process), or by
  Prometheus' ``instance`` where that label is absent, or where two targets exported one
  ``run_instance`` at the same time (one $RLWATCH_RUN_INSTANCE given to two processes); several
  candidates and none named stop with one line listing them (first and last step, first and last
  scrape).
- **The range from the run's own series**: ``count_over_time(rlwatch_step)`` over the lookback in
  ~1,000 windows finds when the run wrote; then every scrape in that range is read as raw samples
  (range selectors, at most 10,000 scrapes per request), so no resolution has to be chosen and a
  fresh run is dated without flags.
"""

from __future__ import annotations

import bisect
import http.client
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ..core.metrics import CATALOGUE
from ..core.values import Values
from .sources import PostmortemInputError, RunData

DEFAULT_DEADLINE_S = 120.0
DEFAULT_LOOKBACK_S = 7 * 86400.0
REQUEST_TIMEOUT_S = 30.0                # one read waits at most this long (and never past the deadline)
#: The size cap on one answer (a raw read of 10,000 scrapes is ~0.35 MB per series).
MAX_BODY_BYTES = 32 * 2 ** 20
CHECK_EVERY = 20_000                    # samples validated between deadline checks
#: An answer is parsed only where the time left allows it at this rate (a JSON parse cannot be stopped
#: midway: a 32 MiB matrix takes ~1-4 s), so the deadline holds through parsing.
PARSE_BYTES_PER_S = 10 * 2 ** 20
WINDOWS = 1000                          # windows of the lookback searched for the run's samples
CHUNK_SCRAPES = 10_000                  # scrapes per raw read
ALERT_TAIL_MS = 10 * 60_000             # alerts read this long after the run's last scrape
_ERRORS = (OSError, http.client.HTTPException, ValueError)


class Deadline:
    """One deadline for a whole command, ``seconds`` from now."""

    def __init__(self, seconds: float = DEFAULT_DEADLINE_S) -> None:
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise PostmortemInputError(f"--deadline must be a positive number of seconds, not {seconds!r}")
        self.seconds = float(seconds)
        self.at = time.monotonic() + self.seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def check(self, what: str) -> None:
        """Stop with one line when the deadline has passed (``what``: where, e.g. the Prometheus' URL)."""
        if self.left() <= 0:
            raise PostmortemInputError(f"{what}: not done within the {self.seconds:g} s deadline; stopped "
                                       "(raise --deadline)")


class _Watched:
    """A connection that hands its socket to ``sockets`` (for the deadline's watchdog)."""

    def __init__(self, *args: Any, sockets: list, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sockets = sockets

    def connect(self) -> None:
        super().connect()
        self._sockets.append(self.sock)


class _WatchedHTTP(_Watched, http.client.HTTPConnection):
    pass


class _WatchedHTTPS(_Watched, http.client.HTTPSConnection):
    pass


class _Handler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    def __init__(self, sockets: list) -> None:
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self)
        self.sockets = sockets

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTP, req, sockets=self.sockets)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPS, req, context=self._context, sockets=self.sockets)


def _shutdown(sockets: list) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)          # a blocked read returns at once
        except OSError:
            pass


class Prometheus:
    """GET requests to Prometheus' HTTP API at ``url``, all within ``deadline``."""

    def __init__(self, url: str, deadline: Deadline) -> None:
        self.url = url.rstrip("/")
        self.deadline = deadline
        if urllib.parse.urlsplit(self.url).scheme not in ("http", "https"):
            raise self.fail("not an http:// or https:// URL")

    def fail(self, what: str) -> PostmortemInputError:
        return PostmortemInputError(f"Prometheus at {self.url}: {what}")

    def get(self, path: str, **params: Any) -> Any:
        """The ``data`` of a successful answer."""
        body = self._fetch(f"{self.url}{path}?{urllib.parse.urlencode(params)}")
        if len(body) / PARSE_BYTES_PER_S > self.deadline.left():
            raise self._late()
        try:
            answer = json.loads(body)
        except RecursionError:
            raise self.fail(f"answered {path} with JSON nested too deeply to read") from None
        except ValueError as exc:
            raise self.fail(f"answered {path} with something that is not JSON ({str(exc)[:100]})") from None
        self.deadline.check(f"Prometheus at {self.url}")          # parsing counts against the deadline too
        if not isinstance(answer, dict) or answer.get("status") != "success":
            reason = answer.get("error") if isinstance(answer, dict) else None
            raise self.fail(f"answered {path} without success: {str(reason or answer)[:200]}")
        if "data" not in answer:
            raise self.fail(f"answered {path} without data")
        return answer["data"]

    def _fetch(self, url: str) -> bytes:
        left = self.deadline.left()
        if left <= 0:
            raise self._late()
        sockets: list = []
        watchdog = threading.Timer(left, _shutdown, (sockets,))
        watchdog.daemon = True
        watchdog.start()
        opener = urllib.request.build_opener(_Handler(sockets))
        announced = 0                      # the Content-Length, where it is over the cap: not read
        try:
            with opener.open(url, timeout=min(REQUEST_TIMEOUT_S, left)) as resp:
                length = (resp.headers.get("Content-Length") or "").strip()
                announced = int(length) if length.isdigit() and int(length) > MAX_BODY_BYTES else 0
                body = b"" if announced else resp.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc) from None
        except _ERRORS as exc:
            if self.deadline.left() <= 0:
                raise self._late() from None
            raise PostmortemInputError(f"cannot query Prometheus at {self.url}: "
                                       f"{getattr(exc, 'reason', None) or exc or type(exc).__name__}") from None
        finally:
            watchdog.cancel()
        if announced:
            raise self._too_large(f"{announced / 2 ** 20:,.0f} MiB")
        if self.deadline.left() <= 0:
            raise self._late()             # the watchdog cut the body short
        if len(body) > MAX_BODY_BYTES:
            raise self._too_large("more")
        return body

    def _too_large(self, size: str) -> PostmortemInputError:
        return self.fail(f"answer of {size} over the {MAX_BODY_BYTES >> 20} MiB size cap; stopped (a shorter "
                         "--since, or a run with fewer label sets per metric)")

    def _http_error(self, exc: urllib.error.HTTPError) -> PostmortemInputError:
        try:
            reason = json.loads(exc.read(65536)).get("error")
        except Exception:  # noqa: BLE001 - any body (or none): the status line says enough
            reason = None
        finally:
            exc.close()
        return self.fail(f"answered HTTP {exc.code} ({exc.reason})" + (f": {str(reason)[:200]}" if reason else ""))

    def _late(self) -> PostmortemInputError:
        return self.fail(f"no complete answer within the {self.deadline.seconds:g} s deadline; stopped "
                         "(raise --deadline)")

    def matrix(self, path: str, **params: Any) -> list[tuple[dict[str, str], list[tuple[int, float]]]]:
        """A matrix answer as ``[(labels, [(time ms, value)])]``, every part checked."""
        data = self.get(path, **params)
        if not isinstance(data, dict) or data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
            raise self.fail(f"answered {path} without a matrix result: {str(data)[:200]}")
        out = []
        for series in data["result"]:
            self.deadline.check(f"Prometheus at {self.url}")
            labels = series.get("metric") if isinstance(series, dict) else None
            points = series.get("values") if isinstance(series, dict) else None
            if not isinstance(labels, dict) or not isinstance(points, list) or \
                    not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
                raise self.fail(f"answered {path} with a malformed series: {str(series)[:200]}")
            samples = []
            for start in range(0, len(points), CHECK_EVERY):
                if start:
                    self.deadline.check(f"Prometheus at {self.url}")
                samples += [self._point(path, p) for p in points[start:start + CHECK_EVERY]]
            out.append((labels, samples))
        return out

    def _point(self, path: str, point: Any) -> tuple[int, float]:
        if isinstance(point, list) and len(point) == 2 and isinstance(point[1], str) \
                and isinstance(point[0], (int, float)) and not isinstance(point[0], bool) and math.isfinite(point[0]):
            try:
                return round(point[0] * 1000), float(point[1])
            except ValueError:
                pass
        raise self.fail(f"answered {path} with a malformed sample: {str(point)[:100]}")


# --- which process of the run -----------------------------------------------------------------

@dataclass
class Instance:
    """One process that exported the run: its identifying labels and what it wrote."""

    run_instance: str
    instance: str
    windows: dict[int, float] = field(default_factory=dict)       # window end (ms) -> samples in it
    window: int = 0                                               # the windows' length (ms)
    step_at: dict[int, int] = field(default_factory=dict)         # scrape time (ms) -> step
    shared: bool = False          # another target exported this run_instance at the same time

    @property
    def name(self) -> str:
        if self.shared:
            return f"{self.run_instance} at {self.instance}"
        return self.run_instance or self.instance or "(unlabelled)"

    def selector(self, run: str) -> str:
        """PromQL label matchers (without braces) for this instance's series of ``run``."""
        pick = [f"run_instance={_q(self.run_instance)}"] if self.run_instance else ['run_instance=""']
        if self.shared or not self.run_instance:
            pick.append(f"instance={_q(self.instance)}")
        return ", ".join([f"run={_q(run)}", *pick])

    def owns(self, labels: dict[str, str], only: bool) -> bool:
        """Whether a series with ``labels`` (an ALERTS series) comes from this instance; one that
        carries neither label is attributed when this is the run's only instance."""
        mine = (("run_instance", self.run_instance), ("instance", self.instance))
        compared = [(labels[k], v) for k, v in mine if labels.get(k) and v]
        return all(a == b for a, b in compared) if compared else only

    def describe(self) -> str:
        if not self.step_at:
            return f"{self.name} (no readable step)"
        times = sorted(self.step_at)
        steps = [self.step_at[t] for t in times]
        return (f"{self.name} (steps {min(steps)}..{max(steps)}, {_utc(times[0])} - {_utc(times[-1])}, "
                f"{len(times)} scrapes)")


def _q(text: str) -> str:
    """A PromQL string literal (its escapes are Go's, a superset of JSON's)."""
    return json.dumps(text, ensure_ascii=False)


def _utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def instances(prom: Prometheus, run: str, start_ms: int, end_ms: int) -> list[Instance]:
    """The processes that exported ``run`` between ``start_ms`` and ``end_ms``, with how many
    ``rlwatch_step`` samples each wrote per window of the range (~1,000 windows)."""
    window = max(1000, math.ceil((end_ms - start_ms) / WINDOWS))
    count = math.ceil((end_ms - start_ms) / window)
    found: dict[tuple[str, str], Instance] = {}
    for labels, points in prom.matrix("/api/v1/query_range", query=f"count_over_time(rlwatch_step{{run="
                                      f"{_q(run)}}}[{window}ms])", start=(end_ms - (count - 1) * window) / 1000,
                                      end=end_ms / 1000, step=f"{window / 1000:g}"):
        key = (labels.get("run_instance", ""), labels.get("instance", ""))
        inst = found.setdefault(key, Instance(*key, window=window))
        for t, n in points:
            if n > 0:
                inst.windows[t] = max(inst.windows.get(t, 0.0), n)
    kept = [i for i in found.values() if i.windows]
    groups: dict[str, list[Instance]] = {}
    for inst in kept:
        groups.setdefault(inst.run_instance, []).append(inst)
    merged = [i for name, group in groups.items() for i in (group if not name else _one_identity(prom, run, group))]
    return sorted(merged, key=lambda i: (min(i.windows), i.name))


def _one_identity(prom: Prometheus, run: str, group: list[Instance]) -> list[Instance]:
    """The targets that exported one ``run_instance``: kept apart (``shared``) when two of them
    wrote at the same time (two processes given one $RLWATCH_RUN_INSTANCE), else one process (seen
    at another address after a restart, say)."""
    if len(group) > 1:
        for inst in group:
            inst.shared = True
            read_steps(prom, run, inst)
        spans = sorted((min(i.step_at), max(i.step_at)) for i in group if i.step_at)
        if any(later[0] <= earlier[1] for earlier, later in zip(spans, spans[1:])):
            return group
    one = Instance(group[0].run_instance, group[0].instance if len(group) == 1 else "", window=group[0].window)
    for inst in group:
        for t, n in inst.windows.items():
            one.windows[t] = max(one.windows.get(t, 0.0), n)
    return [one]


def read_steps(prom: Prometheus, run: str, inst: Instance) -> Instance:
    """``inst`` with every raw ``rlwatch_step`` sample it wrote, read over its windows in chunks of at
    most :data:`CHUNK_SCRAPES` samples (empty windows are skipped)."""
    window = inst.window
    chunk: list[int] = []
    total = 0.0
    for end in sorted(inst.windows) + [None]:
        if chunk and (end is None or total + inst.windows[end] > CHUNK_SCRAPES):
            for labels, points in _raw(prom, f"rlwatch_step{{{inst.selector(run)}}}", chunk[0] - window, chunk[-1]):
                inst.step_at.update((t, int(v)) for t, v in points if math.isfinite(v))
            chunk, total = [], 0.0
        if end is not None:
            chunk.append(end)
            total += inst.windows[end]
    return inst


def _raw(prom: Prometheus, selector: str, after_ms: int, until_ms: int
         ) -> list[tuple[dict[str, str], list[tuple[int, float]]]]:
    """Raw samples of ``selector`` in (after_ms, until_ms] (an instant query of a range selector)."""
    return prom.matrix("/api/v1/query", query=f"{selector}[{max(1, until_ms - after_ms)}ms]",
                       time=f"{until_ms / 1000:.3f}")


def choose(prom: Prometheus, run: str, found: list[Instance], run_instance: str | None) -> Instance:
    """The instance the user named (``run_instance`` or ``instance`` label), or the only one, with
    its steps read; otherwise one line listing them all."""
    named = [i for i in found if run_instance in (i.run_instance, i.instance, i.name)] \
        if run_instance is not None else found
    if len(named) == 1:
        return read_steps(prom, run, named[0])
    listed = "; ".join(read_steps(prom, run, i).describe() for i in found)
    if run_instance is not None:
        raise prom.fail(f"run {run!r} has no single instance {run_instance!r}; its instances: {listed}")
    raise prom.fail(f"{len(found)} processes exported run {run!r}; name one with --run-instance: {listed}")


# --- the run's series ---------------------------------------------------------------------------

def from_prometheus(url: str, run: str, lookback_seconds: float = DEFAULT_LOOKBACK_S, run_instance: str | None = None,
                    end: float | None = None, deadline: Deadline | None = None) -> RunData:
    """Every scrape of one instance of ``run`` within the last ``lookback_seconds`` (before ``end``):
    the catalogue's gauges and the framework scalars keyed by the scrape's step, and the alerts that
    fired (each at the step scraped last before it fired)."""
    prom = Prometheus(url, deadline or Deadline())
    end_ms = round((end or time.time()) * 1000)
    found = instances(prom, run, end_ms - round(lookback_seconds * 1000), end_ms)
    if not found:
        raise prom.fail(f"has no series for run {run!r} in the last {lookback_seconds:g} s (--since)")
    inst = choose(prom, run, found, run_instance)
    if not inst.step_at:
        raise prom.fail(f"run {run!r} ({inst.name}) has no finite rlwatch_step sample")
    which = "run_instance" if inst.run_instance else "instance" if inst.instance else ""
    which = "run_instance and instance" if inst.shared else which
    data = RunData(run=run, source=f"Prometheus {prom.url}" + (f" ({which} {inst.name})" if which else ""))
    times = sorted(inst.step_at)
    chunks = [(times[i] - 1, times[min(i + CHUNK_SCRAPES, len(times)) - 1])
              for i in range(0, len(times), CHUNK_SCRAPES)]
    by_step: dict[int, Values] = {}
    selector = inst.selector(run)
    for spec in CATALOGUE:
        if spec.kind != "gauge" or spec.group in ("config",):
            continue
        for after, until in chunks:
            for labels, points in _raw(prom, f"{spec.full_name}{{{selector}}}", after, until):
                key = tuple(labels.get(name, "") for name in spec.labels)
                for t, v in points:
                    if (s := inst.step_at.get(t)) is not None and math.isfinite(v):
                        by_step.setdefault(s, {}).setdefault(spec.name, {})[key] = v
    data.steps = sorted(by_step.items())
    scalars: dict[str, dict[int, float]] = {}              # several scrapes of one step: its last value
    for after, until in chunks:
        for labels, points in _raw(prom, f"rlwatch_framework_metric{{{selector}}}", after, until):
            for t, v in points:
                if (s := inst.step_at.get(t)) is not None and math.isfinite(v):
                    scalars.setdefault(labels.get("name", ""), {})[s] = v
    data.scalars = {name: sorted(points.items()) for name, points in scalars.items()}
    data.alerts = _alerts(prom, run, inst, len(found) == 1, times, min(end_ms, times[-1] + ALERT_TAIL_MS))
    return data


def _alerts(prom: Prometheus, run: str, inst: Instance, only: bool, times: list[int], until_ms: int
            ) -> list[dict[str, Any]]:
    """One entry per firing ALERTS series of ``inst``, at the step scraped last before it first fired."""
    first: dict[tuple, tuple[int, dict[str, str]]] = {}
    bounds = [times[0] - 1] + times[CHUNK_SCRAPES - 1::CHUNK_SCRAPES] + [until_ms]
    for after, until in zip(bounds, bounds[1:]):
        if until <= after:
            continue
        for labels, points in _raw(prom, f'ALERTS{{run={_q(run)}, alertstate="firing"}}', after, until):
            key = tuple(sorted(labels.items()))
            if points and inst.owns(labels, only) and (key not in first or points[0][0] < first[key][0]):
                first[key] = (points[0][0], labels)         # raw samples come in time order
    alerts = []
    for at, labels in sorted(first.values(), key=lambda x: x[0]):
        labels = {k: v for k, v in labels.items() if k not in ("__name__", "alertstate")}
        i = bisect.bisect_right(times, at)
        alerts.append(dict(name=labels.pop("alertname", "?"), severity=labels.pop("severity", ""), state="firing",
                           step=inst.step_at[times[max(i - 1, 0)]], time=at / 1000, labels=labels))
    return alerts
