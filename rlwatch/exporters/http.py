"""The exporter's HTTP server: bounded against slow and hostile clients, and safe across ``fork``.

One thread accepts connections and reads their request heads without blocking (and runs the TLS
handshakes), each connection under one deadline for its whole head: a client trickling a byte every
second gets no more time than one that sends nothing. Complete requests go to a few short-lived
worker threads that run the WSGI app. At most ``max_connections`` connections are held; when they
are all taken, the one that has waited longest for its head is dropped for the newcomer, so clients
that trickle cannot keep a scraper out. A forked child (DataLoader workers fork the trainer) closes
its copies of the server's sockets at once, so the parent alone owns the port.
"""

from __future__ import annotations

import base64
import collections
import errno
import hmac
import io
import logging
import os
import selectors
import socket
import ssl
import sys
import threading
import time
import weakref
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler

from ..errors import PortInUseError

logger = logging.getLogger("rlwatch")

#: Largest request head accepted (request line and headers), bytes.
MAX_HEAD = 16384
_HEAD_END = (b"\r\n\r\n", b"\n\n")

_SERVERS: weakref.WeakSet[MetricsServer] = weakref.WeakSet()


def _close_in_child() -> None:
    for server in list(_SERVERS):
        server._forget()


os.register_at_fork(after_in_child=_close_in_child)


class _Pending:
    """A connection still sending its request head."""

    __slots__ = ("conn", "addr", "deadline", "head", "handshaken")

    def __init__(self, conn: socket.socket, addr: tuple, deadline: float) -> None:
        self.conn, self.addr, self.deadline = conn, addr, deadline
        self.head = b""
        self.handshaken = not isinstance(conn, ssl.SSLSocket)


class _Handler(WSGIRequestHandler):
    """wsgiref's request handling over a head already read (the body of a GET or HEAD is empty)."""

    def __init__(self, conn: socket.socket, addr: tuple, server: MetricsServer, head: bytes) -> None:
        self._head = head
        super().__init__(conn, addr, server)

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = io.BytesIO(self._head)
        self.wfile = self.request.makefile("wb", buffering=0)

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


def _bind(addr: str, candidates: list[int]) -> tuple[socket.socket | None, OSError | None]:
    last_error = None
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    for candidate in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        # SO_REUSEADDR, as every HTTP server sets it: the port of a run that just exited (its scraped
        # connections in TIME-WAIT) can be bound again at once. On Linux it never lets two servers
        # share a port that one of them still listens on: a taken port still fails with EADDRINUSE.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, candidate))
            sock.listen(128)
            return sock, None
        except OSError as exc:
            sock.close()
            last_error = exc
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                break
    return None, last_error


class _HeadReader:
    """The accepting thread: takes connections, runs their TLS handshakes and reads their request
    heads without blocking, each under one deadline; hands each complete head to ``dispatch``. At
    most ``max_connections`` connections are held, counting the ``busy()`` ones being answered:
    beyond, the connection that has waited longest for its head is dropped for the newcomer."""

    def __init__(self, sock: socket.socket, header_timeout: float, max_connections: int,
                 busy: Callable[[], int], dispatch: Callable[[socket.socket, tuple, bytes], None]) -> None:
        self.socket, self.header_timeout, self.max_connections = sock, header_timeout, max_connections
        self.busy, self.dispatch = busy, dispatch
        self.pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()   # oldest first
        self.closing = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="rlwatch-metrics", daemon=True)
        self._thread.start()

    def _oldest(self) -> _Pending | None:
        return next(iter(self.pending.values()), None)

    def _loop(self) -> None:
        while not self.closing:
            first = self._oldest()
            wait = None if first is None else max(0.0, first.deadline - time.monotonic())
            for key, _ in self._selector.select(wait):
                if key.fileobj is self.socket:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._wake_r.recv(64)
                else:
                    self._advance(key.data)
            now = time.monotonic()
            while (first := self._oldest()) is not None and first.deadline <= now:
                self._drop(first, b"408 Request Timeout")

    def _accept(self) -> None:
        for _ in range(self.max_connections):
            try:
                conn, addr = self.socket.accept()
            except OSError:          # none waiting (BlockingIOError), or out of descriptors: later
                return
            conn.setblocking(False)
            if len(self.pending) + self.busy() >= self.max_connections:
                if not self.pending:
                    conn.close()
                    continue
                self._drop(self._oldest(), b"503 Service Unavailable")
            pending = _Pending(conn, addr, time.monotonic() + self.header_timeout)
            self.pending[conn.fileno()] = pending
            self._selector.register(conn, selectors.EVENT_READ, pending)
            self._advance(pending)

    def _advance(self, pending: _Pending) -> None:
        """Read what the client sent (after the TLS handshake); hand a complete head on."""
        conn = pending.conn
        try:
            if not pending.handshaken:
                conn.do_handshake()
                pending.handshaken = True
            while True:
                chunk = conn.recv(MAX_HEAD + 1 - len(pending.head))
                if not chunk:
                    self._drop(pending)
                    return
                pending.head += chunk
                if any(end in pending.head for end in _HEAD_END):
                    self._unregister(pending)
                    self.dispatch(conn, pending.addr, pending.head)
                    return
                if len(pending.head) > MAX_HEAD:
                    self._drop(pending, b"431 Request Header Fields Too Large")
                    return
        except ssl.SSLWantWriteError:
            self._selector.modify(conn, selectors.EVENT_WRITE, pending)
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            self._selector.modify(conn, selectors.EVENT_READ, pending)
        except (OSError, ValueError):
            self._drop(pending)

    def _unregister(self, pending: _Pending) -> None:
        self.pending.pop(pending.conn.fileno(), None)
        try:
            self._selector.unregister(pending.conn)
        except (KeyError, ValueError):
            pass

    def _drop(self, pending: _Pending, status: bytes = b"") -> None:
        """Close a connection that has not sent its head, with a one-line answer if it can take one."""
        self._unregister(pending)
        if status and pending.handshaken:
            try:
                pending.conn.send(b"HTTP/1.0 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except (OSError, ValueError):
                pass
        pending.conn.close()

    def stop(self) -> None:
        self.closing = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for pending in list(self.pending.values()):
            self._drop(pending)
        self._selector.close()
        for sock in (self.socket, self._wake_r, self._wake_w):
            sock.close()

    def sockets(self) -> list[socket.socket]:
        return [self.socket, self._wake_r, self._wake_w, *(p.conn for p in list(self.pending.values()))]

    def forget(self) -> None:
        """In a forked child: close this process's copies of the sockets (see MetricsServer._forget)."""
        self.closing = True
        _close_copies(self.sockets())
        try:
            self._selector.close()
        except (OSError, RuntimeError):
            pass


class MetricsServer:
    """A WSGI app (``/metrics`` and the pages around it) over HTTP(S) on daemon threads.

    port=0 picks a free port; with ``port_fallback`` a taken port moves on to the next 32 ports.
    Raises :class:`PortInUseError` when no port could be bound. A client has ``header_timeout``
    seconds to send its whole request head (TLS handshake included); ``timeout`` bounds each write
    of the answer; ``workers`` requests are answered at once; ``max_connections`` are held at most.
    """

    def __init__(self, registry: object, addr: str = "127.0.0.1", port: int = 9400, *,
                 port_fallback: bool = False, certfile: str | None = None, keyfile: str | None = None,
                 basic_auth: tuple[str, str] | None = None, app: Callable | None = None,
                 header_timeout: float = 5.0, timeout: float = 10.0, max_connections: int = 64, workers: int = 4,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        if app is None:
            from prometheus_client import make_wsgi_app

            app = make_wsgi_app(registry)
        if basic_auth is not None:
            app = _with_basic_auth(app, *basic_auth)
        self._app = _never_raise(app, on_error)
        self.timeout, self.workers, self.on_error = timeout, workers, on_error
        candidates = [port] if (port == 0 or not port_fallback) else list(range(port, port + 33))
        sock, last_error = _bind(addr, candidates)
        if sock is None:
            raise PortInUseError(
                f"cannot serve /metrics on {addr}:{port}: {last_error}. Pass port=0 for any free port, "
                f"port_fallback=True to try the next ports, or port=None to disable the endpoint.")
        if port and sock.getsockname()[1] != port:
            reason = last_error.strerror if last_error is not None else "in use"
            logger.warning("rlwatch: cannot serve /metrics on %s:%d (%s: another process listens there); serving on "
                           "port %d instead (port_fallback)", addr, port, reason, sock.getsockname()[1])
        if certfile:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile, keyfile)
            sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        sock.setblocking(False)
        self.addr = addr
        self.port = sock.getsockname()[1]
        self.scheme = "https" if certfile else "http"
        self.base_environ = {"SERVER_NAME": addr, "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_PORT": str(self.port),
                             "REMOTE_HOST": "", "CONTENT_LENGTH": "", "SCRIPT_NAME": ""}
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._ready: collections.deque[tuple[socket.socket, tuple, bytes]] = collections.deque()
        self._serving: set[socket.socket] = set()     # connections a worker answers
        self._busy_workers = 0
        self._closed = False
        self._reader = _HeadReader(sock, header_timeout, max_connections, self._busy, self._dispatch)
        _SERVERS.add(self)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{self.scheme}://{host}:{self.port}/metrics"

    @property
    def runbook_url(self) -> str:
        """The runbook this server serves, at an address a person can open (the node's address
        when it listens on every interface)."""
        from ..discovery import node_address

        host = node_address(self.addr)
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{self.port}/runbook"

    def get_app(self) -> Callable:
        return self._app

    def _busy(self) -> int:
        with self._lock:
            return len(self._ready) + len(self._serving)

    def _dispatch(self, conn: socket.socket, addr: tuple, head: bytes) -> None:
        with self._lock:
            self._ready.append((conn, addr, head))
            if self._busy_workers >= self.workers:
                return
            self._busy_workers += 1
        threading.Thread(target=self._work, name="rlwatch-metrics-request", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._ready or self._closed:
                    self._busy_workers -= 1
                    return
                conn, addr, head = self._ready.popleft()
                self._serving.add(conn)
            try:
                conn.settimeout(self.timeout)
                _Handler(conn, addr, self, head)
            except Exception as exc:  # noqa: BLE001 - a client that resets costs its own connection only
                if self.on_error is not None and not isinstance(exc, (OSError, ssl.SSLError)):
                    self.on_error("server", exc)
            finally:
                with self._lock:
                    self._serving.discard(conn)
                _close(conn)

    def close(self) -> None:
        """Stop accepting, drop waiting connections, let the requests being answered finish (bounded)."""
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        self._reader.stop()
        with self._lock:
            ready = list(self._ready)
            self._ready.clear()
        for conn, _, _ in ready:
            _close(conn)
        deadline = time.monotonic() + self.timeout
        while self._busy_workers and time.monotonic() < deadline:
            time.sleep(0.01)
        _SERVERS.discard(self)

    def _forget(self) -> None:
        """In a forked child: close this process's copies of every socket, touching nothing the
        parent uses (no shutdown, no TLS close_notify, no lock that a parent thread may hold)."""
        self._closed = True
        self._reader.forget()
        _close_copies([*(c for c, _, _ in list(self._ready)), *list(self._serving)])


def _close_copies(socks: list[socket.socket]) -> None:
    for sock in socks:          # close() of a socket another process shares sends nothing to the peer
        try:
            sock.close()
        except OSError:
            pass


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    conn.close()
