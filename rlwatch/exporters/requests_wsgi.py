"""Requests of the exporter's HTTP server (:mod:`rlwatch.exporters.http`) parsed and answered in
memory by :mod:`wsgiref`: whether a head is whole, the WSGI app wrapped so that it never raises and
(optionally) asks for basic auth, and the 4xx answers counted as the client's errors."""

from __future__ import annotations

import base64
import collections
import hmac
import io
import sys
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIRequestHandler


def head_complete(head: bytes) -> bool:
    """Whether a request head is whole: its blank line arrived, or its request line is not of the
    ``METHOD target HTTP/x.y`` form (an HTTP/0.9 ``GET /metrics`` has no headers; a malformed line
    is answered 400 at once)."""
    line, newline, _ = head.partition(b"\n")
    if not newline:
        return False
    if len(line.split()) != 3:
        return True
    return b"\r\n\r\n" in head or b"\n\n" in head


class _Request(WSGIRequestHandler):
    """wsgiref's request handling over a head already read, answering into memory (the body of a
    GET or HEAD is empty): :attr:`answer` holds the bytes to send."""

    def __init__(self, head: bytes, addr: tuple, server: Any) -> None:
        self._head = head
        super().__init__(None, addr, server)

    def setup(self) -> None:
        self.rfile = io.BytesIO(self._head)
        self.wfile = _Parts()

    def finish(self) -> None:
        self.answer = self.wfile.parts

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if not self.path.startswith("/"):      # absolute form (``GET http://host/metrics``): its path
            try:
                parts = urlsplit(self.path)
            except ValueError:                 # ``http://[::1/metrics``: the client's error, a 400
                self.send_error(400, "Bad request target")
                return False
            if parts.scheme and parts.netloc:
                self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - wsgiref's signature
        pass

    def get_stderr(self) -> "_Discard":
        return _Discard()


class _Parts:
    """wsgiref's output stream, keeping each bytes object written by reference: the cached
    exposition is shared by every connection sending it, never copied per connection."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(data if type(data) is bytes else bytes(data))
        return len(data)

    def flush(self) -> None: ...


class _Discard:
    """wsgi.errors: application errors are counted by :func:`_never_raise`, not printed."""

    def write(self, text: str) -> None: ...

    def flush(self) -> None: ...


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


def _count_client_error(counts: collections.Counter[str], answer: bytes) -> None:
    """Count a 4xx answer (``HTTP/1.x 4NN ...`` or a bare status) in ``counts``, by code: a client's
    bad request is the client's error, never the hook's."""
    fields = answer[:32].split(None, 2)
    code = fields[1] if answer.startswith(b"HTTP/") and len(fields) > 1 else fields[0] if fields else b""
    if len(code) == 3 and code.startswith(b"4") and code.isdigit():
        counts[code.decode()] += 1


def _status_only(status: bytes) -> bytes:
    return b"HTTP/1.0 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
