"""Alert notifiers for the embedded evaluator: a generic JSON webhook and a Slack-compatible one.

Notifications leave the training thread through a bounded queue to one sender thread, with a
timeout per request, de-duplication (the same alert in the same state is not re-sent within
``repeat_seconds``) and a rate limit per notifier. URLs and tokens never appear in logs, errors
or the run store: only the scheme and host are ever shown. The console side of an event is one log
line (:func:`log_event`); :func:`quiet_alert_log` holds those lines back for a caller that prints them itself.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import socket
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol
from urllib.parse import urlsplit

from ..core.queues import stop_consumer, wait_drained

logger = logging.getLogger("rlwatch")


@dataclass(frozen=True)
class AlertEvent:
    """A firing or resolved alert of one run."""

    name: str
    severity: str
    state: str                     # "firing" | "resolved"
    run: str
    step: int | None
    labels: dict[str, str]
    value: float | None
    summary: str
    description: str
    runbook_url: str
    time: float = field(default_factory=time.time)
    value_format: str = "value {:.4g}"       # the alert's (Alert.value_format): the value named, with its unit

    @property
    def value_text(self) -> str:
        """The value in one phrase with its name and unit ("k3 0.2304 nats"); "" without a value."""
        if self.value is None:
            return ""
        try:
            return self.value_format.format(self.value)
        except (ValueError, TypeError, IndexError, KeyError):
            return f"value {self.value:.4g}"

    @property
    def key(self) -> tuple:
        return (self.name, tuple(sorted(self.labels.items())))


def redact(url: str) -> str:
    """scheme://host[:port]/… with path, query and credentials removed (paths carry tokens)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:                # an invalid port: show nothing of it
        return "<invalid URL>"
    return f"{parts.scheme}://{host}{port}/…"


def scrub(message: str, url: str) -> str:
    """``message`` without ``url`` or any secret part of it (credentials, path, query): error texts
    of HTTP libraries sometimes quote the URL they were given."""
    secrets = [url]
    try:
        parts = urlsplit(url)
        secrets += [parts.username, parts.password, parts.path.strip("/"), parts.query]
    except ValueError:
        pass
    for secret in sorted({s for s in secrets if s and len(s) >= 3}, key=len, reverse=True):
        message = message.replace(secret, redact(url) if secret == url else "…")
    return message


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def slack_escape(text: Any) -> str:
    """Text from a run made inert in a Slack message: ``&``, ``<`` and ``>`` escaped as Slack
    requires (no ``<!channel>``, no ``<url|text>`` links), control characters removed."""
    from ..core.record import clean_text

    text = _CONTROL.sub("", clean_text(text))
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Notifier(Protocol):
    name: str

    def send(self, events: list[AlertEvent]) -> None: ...


class WebhookNotifier:
    """POSTs an Alertmanager-style JSON payload (``version``, ``status``, ``alerts`` [...])."""

    name = "webhook"

    def __init__(self, url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> None:
        self._url = url
        self.timeout = timeout
        self._headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"WebhookNotifier({redact(self._url)})"

    def payload(self, events: list[AlertEvent]) -> dict[str, Any]:
        firing = any(e.state == "firing" for e in events)
        return {
            "version": "4", "receiver": "rlwatch", "status": "firing" if firing else "resolved",
            "alerts": [{
                "status": e.state,
                "labels": {"alertname": e.name, "severity": e.severity, "run": e.run, **e.labels},
                "annotations": {"summary": e.summary, "description": e.description, "runbook_url": e.runbook_url},
                "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e.time)),
                "values": {"value": e.value, "step": e.step},
            } for e in events],
        }

    def send(self, events: list[AlertEvent]) -> None:
        _post_json(self._url, self.payload(events), self.timeout, self._headers)


class SlackNotifier:
    """Posts a text message to a Slack-compatible incoming webhook."""

    name = "slack"

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self._url = url
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"SlackNotifier({redact(self._url)})"

    @staticmethod
    def text(events: list[AlertEvent]) -> str:
        lines = []
        for e in events:
            icon = ":rotating_light:" if e.state == "firing" and e.severity == "critical" else (
                ":warning:" if e.state == "firing" else ":white_check_mark:")
            value = "" if e.value is None else f" ({slack_escape(e.value_text)}, step {e.step})"
            lines.append(f"{icon} [{e.state.upper()}] {slack_escape(e.name)} - {slack_escape(e.description)}"
                         f"{value} <{slack_escape(e.runbook_url).replace('|', '%7C')}|runbook>")
        return "\n".join(lines)

    def send(self, events: list[AlertEvent]) -> None:
        _post_json(self._url, {"text": self.text(events)}, self.timeout, {})


def _post_json(url: str, body: dict[str, Any], timeout: float, headers: dict[str, str]) -> None:
    """POST ``body`` as JSON; the whole request (connect, send, response) ends within about
    ``timeout`` seconds: a receiver that trickles its answer a byte at a time is cut off."""
    import http.client

    data = json.dumps(body).encode()
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise NotifyError(f"{redact(url)}: only http(s) URLs are supported")
        https = parts.scheme == "https"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        proxy = None if urllib.request.proxy_bypass(parts.hostname) else \
            urllib.request.getproxies().get(parts.scheme)
        if proxy:                                              # honour http(s)_proxy like urllib
            proxy_parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            host, port = proxy_parts.hostname, proxy_parts.port or (443 if proxy_parts.scheme == "https" else 80)
        else:
            host, port = parts.hostname, parts.port
        conn_class = http.client.HTTPSConnection if https and not proxy else http.client.HTTPConnection
        conn = conn_class(host, port, timeout=timeout)
        if proxy and https:
            conn = http.client.HTTPSConnection(host, port, timeout=timeout)
            conn.set_tunnel(parts.hostname, parts.port or 443)
        elif proxy:
            target = url
    except NotifyError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise NotifyError(f"POST to {redact(url)} failed: {type(exc).__name__}") from None
    expired = threading.Event()

    def expire() -> None:                 # unblocks a read or write stuck on the socket
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        conn.request("POST", target, body=data, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        resp.read(1 << 20)
        status = resp.status
    except Exception as exc:  # noqa: BLE001 - rewrap without the URL (it may carry a token)
        reason = f"no complete answer within {timeout:g} s" if expired.is_set() else type(exc).__name__
        raise NotifyError(f"POST to {redact(url)} failed: {reason}") from None
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():
        raise NotifyError(f"POST to {redact(url)} failed: no complete answer within {timeout:g} s")
    if status >= 300:
        raise NotifyError(f"{redact(url)} answered HTTP {status}")


class NotifyError(Exception):
    """A notification could not be delivered (message never contains the full URL)."""


class Dispatcher:
    """Sends alert events to notifiers off the training thread; bounded, de-duplicated, rate-limited."""

    def __init__(self, notifiers: list[Notifier], on_error: Callable[[str, str], None], max_queue: int = 256,
                 repeat_seconds: float = 3600.0, max_per_minute: int = 20) -> None:
        self.notifiers = list(notifiers)
        self._on_error = on_error
        self.repeat_seconds = repeat_seconds
        self.max_per_minute = max_per_minute
        self.dropped = 0
        self.sent = 0
        self._last_sent: dict[tuple, tuple[str, float]] = {}
        self._window: dict[str, list[float]] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="rlwatch-notify", daemon=True)
        self._thread.start()

    def submit(self, event: AlertEvent) -> None:
        last = self._last_sent.get(event.key)
        if last is not None and last[0] == event.state and event.time - last[1] < self.repeat_seconds:
            return                                               # duplicate within the repeat interval
        self._last_sent[event.key] = (event.state, event.time)
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            self._on_error("queue_full", "notification queue full; event dropped")

    def _allowed(self, notifier: Notifier, now: float) -> bool:
        window = [t for t in self._window.get(notifier.name, []) if now - t < 60.0]
        if len(window) >= self.max_per_minute:
            self._window[notifier.name] = window
            return False
        window.append(now)
        self._window[notifier.name] = window
        return True

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                self._queue.task_done()
                return
            batch = [event]
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put_nowait(None)
                    self._queue.task_done()
                    break
                batch.append(more)
            for notifier in self.notifiers:
                if not self._allowed(notifier, time.time()):
                    self.dropped += len(batch)
                    self._on_error("rate_limited", f"{notifier.name}: over {self.max_per_minute}/min; dropped")
                    continue
                try:
                    notifier.send(batch)
                    self.sent += len(batch)
                except Exception as exc:  # noqa: BLE001 - a down receiver never reaches the trainer
                    self._on_error("send", f"{notifier.name}: {exc}")
            for _ in batch:
                self._queue.task_done()

    def flush(self, timeout: float = 10.0) -> bool:
        return wait_drained(self._queue, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (at most ``timeout`` s), then stop the sending thread."""
        self.flush(timeout)
        stop_consumer(self._queue, self._thread, timeout)


def _printable(text: Any) -> str:
    """A label value for a console line: control characters (ESC sequences, newlines) escaped."""
    return _CONTROL_ALL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


_CONTROL_ALL = re.compile("[\x00-\x1f\x7f-\x9f]")


_K3_CONTEXT = re.compile(r", \d+x its baseline|; at this rate (?:kl_k3_max|policy_kl_max) in ~\d+ steps")


#: How every alert line of the console log starts.
ALERT_LINE = "rlwatch alert "


class _NoAlertLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ALERT_LINE)


@contextmanager
def quiet_alert_log() -> Iterator[None]:
    """Without the alert lines :func:`log_event` writes, for a caller that reports each transition itself
    (the demo's live view, a replay's table); rlwatch's other log lines pass."""
    quiet = _NoAlertLines()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def log_event(event: AlertEvent) -> None:
    """The console side of an event: one log line, a resolution at the level of a firing (WARNING), so
    that wherever a firing is printed (Python's default handler shows WARNING and above) its
    resolution is too."""
    level = logging.WARNING
    labels = ", ".join(f"{k}={_printable(v)}" for k, v in sorted(event.labels.items()))
    value = "" if event.value is None else f": {event.value_text}"
    # The k3 context of a mismatch alert (x its baseline; steps left to kl_k3_max at this trend), or the steps
    # left to policy_kl_max of a policy-KL departure, when known.
    trend = "".join(_K3_CONTEXT.findall(event.description))
    logger.log(level, ALERT_LINE + "%s %s [%s] run=%s step=%s%s%s%s - %s (%s)", event.state.upper(), event.name,
               event.severity, _printable(event.run), event.step, f" {labels}" if labels else "", value, trend,
               _printable(event.summary), _printable(event.runbook_url))
