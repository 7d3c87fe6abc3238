"""The exporter's HTTP server: asyncio on one thread, bounded against slow and hostile clients, safe
across ``fork``.

The transport is :mod:`asyncio`'s (non-blocking reads and writes, TLS handshakes with a timeout);
each request head is parsed and answered by :mod:`wsgiref`'s request handler (what prometheus_client's
own server runs) into memory, and the answer is handed to the transport. So no client blocks
another: a client that never reads costs its own connection only (its answer waits in memory, and
the connection is aborted after ``timeout`` seconds), and the server starts no thread after its own,
so a process out of threads still serves. The server accepts connections itself: out of file
descriptors it counts the error and waits a second instead of spinning, and it keeps its CPU (which
is the trainer's GIL) to :data:`CPU_SHARE` of a core, so a flood of complete requests waits in the
kernel's backlog instead of slowing the trainer. Only answers count against that share: a request
still arriving costs a bounded number of reads (:data:`MAX_HEAD_READS`, :data:`MAX_HEAD` bytes) and
is never read again once they are spent, so clients trickling their heads neither slow the trainer
nor stop the server accepting the scrapes behind them. Each connection has one deadline for its
TLS handshake and its whole request head; at most ``max_connections`` are held, and when they are
all taken the one that has waited longest for its head is dropped for the newcomer. A forked child (DataLoader workers
fork the trainer) lets go of its copies of the server's sockets at once, so the parent alone owns
the port.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import socket
import ssl
import threading
import time
import weakref
from typing import Callable

from ..core.errors import PortInUseError
from .requests_wsgi import (_count_client_error, _never_raise, _Request, _status_only, _with_basic_auth,
                            head_complete)

logger = logging.getLogger("rlwatch")

#: Largest request head accepted (request line and headers), bytes.
MAX_HEAD = 16384
#: Reads a request head may take: a client sends its head in one or a few writes; one trickling it
#: byte by byte is no longer read (it waits for its deadline) once it has had this many.
MAX_HEAD_READS = 32
#: Bytes of an answer handed to a connection's transport at once (the rest waits until it drains).
WRITE_SLICE = 65536
#: Seconds that answers still being written get to finish when the server closes.
CLOSE_GRACE = 1.0
#: Share of one core (and of the trainer's GIL) the server may spend answering, on average, and the
#: CPU seconds it may spend at once: beyond, new connections wait in the kernel's backlog a moment.
CPU_SHARE, CPU_BURST = 0.1, 0.05
#: Errors of accept() that mean "out of a resource": accepting pauses a second instead of spinning.
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

_SERVERS: weakref.WeakSet[MetricsServer] = weakref.WeakSet()


def _close_in_child() -> None:
    for server in list(_SERVERS):
        server._forget()


os.register_at_fork(after_in_child=_close_in_child)


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


class _Connection(asyncio.Protocol):
    """One client: reads its request head under one deadline (from its accept, TLS handshake
    included), answers it, and gives the answer ``timeout`` seconds to be read before aborting."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.deadline = server._loop.time() + server.header_timeout       # accepted now
        self.head = bytearray()
        self.reads = 0
        self.pending: collections.deque[memoryview] = collections.deque()     # the answer not yet written
        self.paused = False
        self.answered_at: float | None = None                              # None: still reading its head
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.server._admit(self):
            transport.abort()
            return
        self.timer = self.server._loop.call_at(self.deadline, self.drop, b"408 Request Timeout")

    def data_received(self, data: bytes) -> None:
        if self.answered_at is not None:           # anything after the head: read and ignored
            return
        self.head += data
        self.reads += 1
        if b"\n" in data and head_complete(bytes(self.head)):        # a head ends with a line
            self.answer()
        elif len(self.head) > MAX_HEAD:
            self.drop(b"431 Request Header Fields Too Large")
        elif self.reads >= MAX_HEAD_READS:         # a trickling client: not read again before its deadline
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.answered_at is None:               # the client gave up before its head was whole
            self.drop()
        return False

    def answer(self) -> None:
        self.answered_at = self.server._loop.time()
        if self.timer is not None:
            self.timer.cancel()
        cpu = time.thread_time()
        parts = self.server._respond(bytes(self.head), self.transport.get_extra_info("peername"))
        _count_client_error(self.server.client_errors, parts[0] if parts else b"")
        self.pending = collections.deque(memoryview(part) for part in parts if part)
        self.head = bytearray()
        self.server._pace(time.thread_time() - cpu)
        self.timer = self.server._loop.call_later(self.server.timeout, self.transport.abort)
        self.send_more()

    def send_more(self) -> None:
        """Hand the answer to the transport a slice at a time while it is not full: a client that
        reads slowly or never holds at most one slice and the transport's buffer, whatever the size."""
        while self.pending and not self.paused and not self.transport.is_closing():
            part = self.pending[0]
            self.transport.write(part[:WRITE_SLICE])
            if len(part) > WRITE_SLICE:
                self.pending[0] = part[WRITE_SLICE:]
            else:
                self.pending.popleft()
        if not self.pending and not self.transport.is_closing():
            self.transport.close()                 # once the answer is written

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.send_more()

    def drop(self, status: bytes = b"") -> None:
        """Close a connection that has not sent its head, with a one-line answer."""
        if self.timer is not None:
            self.timer.cancel()
        self.answered_at = self.server._loop.time()
        if status and not self.transport.is_closing():
            self.transport.write(_status_only(status))
            _count_client_error(self.server.client_errors, status)
        self.transport.close()
        self.timer = self.server._loop.call_later(1.0, self.transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.server._connections.pop(self, None)


class MetricsServer:
    """A WSGI app (``/metrics`` and the pages around it) over HTTP(S), served by an asyncio loop on
    one daemon thread.

    port=0 picks a free port; with ``port_fallback`` a taken port moves on to the next 32 ports.
    Raises :class:`PortInUseError` when no port could be bound. A client has ``header_timeout``
    seconds to send its whole request head (TLS handshake included) and ``timeout`` seconds to read
    the answer; ``max_connections`` are held at most. ``workers`` is accepted for compatibility:
    requests are answered on the server's thread, one after another.
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
        self.header_timeout, self.timeout, self.max_connections = header_timeout, timeout, max_connections
        self.workers, self.on_error = workers, on_error
        self.client_errors: collections.Counter[str] = collections.Counter()    # 4xx answers, by code
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
        context = None
        if certfile:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile, keyfile)
        self.addr = addr
        self.port = sock.getsockname()[1]
        self.scheme = "https" if certfile else "http"
        self.base_environ = {"SERVER_NAME": addr, "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_PORT": str(self.port),
                             "REMOTE_HOST": "", "CONTENT_LENGTH": "", "SCRIPT_NAME": ""}
        self._pid = os.getpid()
        self._socket = sock
        self._ssl = context
        self._accepted: weakref.WeakSet[socket.socket] = weakref.WeakSet()     # every client socket
        self._connections: collections.OrderedDict[_Connection, None] = collections.OrderedDict()  # oldest first
        self._closed = False
        self._accepting = False
        self._budget, self._mark = CPU_BURST, 0.0        # answering CPU seconds left; loop time of the last count
        sock.setblocking(False)
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._loop_error)
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlwatch-metrics", daemon=True)
        try:
            self._thread.start()       # the only thread the server starts; a caller in its own asyncio loop works too
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        except BaseException:
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(2)
            sock.close()
            if not self._thread.is_alive():
                self._loop.close()
            raise
        _SERVERS.add(self)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{self.scheme}://{host}:{self.port}/metrics"

    @property
    def runbook_url(self) -> str:
        """The runbook this server serves, at an address a person can open (the node's address
        when it listens on every interface)."""
        from ..runs.discovery import node_address

        host = node_address(self.addr)
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{self.port}/runbook"

    def get_app(self) -> Callable:
        return self._app

    def _respond(self, head: bytes, addr: tuple | None) -> list[bytes]:
        """The answer's parts for a whole request head (parsed and answered by wsgiref, in memory)."""
        try:
            return _Request(head, addr or ("", 0), self).answer
        except Exception as exc:  # noqa: BLE001 - a request costs its own connection only
            if self.on_error is not None:
                self.on_error("server", exc)
            return [_status_only(b"500 Internal Server Error")]

    async def _start(self) -> None:
        self._mark = self._loop.time()
        self._resume()

    def _resume(self) -> None:
        if not self._closed and not self._accepting:
            self._loop.add_reader(self._socket.fileno(), self._accept)
            self._accepting = True

    def _pause(self, seconds: float) -> None:
        """Leave new connections in the kernel's backlog for ``seconds``."""
        if self._accepting:
            self._loop.remove_reader(self._socket.fileno())
            self._accepting = False
            self._loop.call_later(seconds, self._resume)

    def _pace(self, spent: float) -> None:
        """Keep the CPU the server spends answering to :data:`CPU_SHARE` on average: when the budget
        is spent (a flood of complete requests), pause accepting until it is back. ``spent``: thread
        CPU seconds of the answer just given. Reading heads never counts here (it is bounded per
        connection), so clients that never finish a request cannot hold the scrapers out."""
        now = self._loop.time()
        self._budget = min(CPU_BURST, self._budget + (now - self._mark) * CPU_SHARE - spent)
        self._mark = now
        if self._budget < 0:
            self._pause(-self._budget / CPU_SHARE)

    def _accept(self) -> None:
        for _ in range(16):
            try:
                conn, _ = self._socket.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:       # out of descriptors: counted, retried in a second
                    self._loop_error(self._loop, {"exception": exc})
                    self._pause(1.0)
                    return
                continue                                 # a client that left before its accept
            conn.setblocking(False)
            self._accepted.add(conn)
            connection = _Connection(self)
            extra = {"ssl_handshake_timeout": self.header_timeout} if self._ssl is not None else {}
            task = self._loop.create_task(self._loop.connect_accepted_socket(
                lambda protocol=connection: protocol, conn, ssl=self._ssl, **extra))
            task.add_done_callback(_retrieve)

    def _admit(self, conn: _Connection) -> bool:
        """Hold ``conn`` if there is room, dropping the connection that has waited longest for its
        head (else the oldest answer unread for a second) when all ``max_connections`` are held."""
        if len(self._connections) >= self.max_connections:
            now = self._loop.time()
            victim = next((c for c in self._connections if c.answered_at is None), None)
            if victim is None:
                victim = next((c for c in self._connections if now - c.answered_at > 1.0), None)
            if victim is None:
                return False
            self._connections.pop(victim, None)
            if victim.answered_at is None:
                victim.drop(b"503 Service Unavailable")
            else:
                victim.transport.abort()
        self._connections[conn] = None
        return True

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """asyncio's unexpected errors (out of descriptors on accept, ...): counted, never printed."""
        exc = context.get("exception") or RuntimeError(context.get("message", "asyncio error"))
        if self.on_error is not None:
            try:
                self.on_error("server", exc)
            except Exception:  # noqa: BLE001
                pass

    async def _shutdown(self) -> None:
        if self._accepting:
            self._loop.remove_reader(self._socket.fileno())
            self._accepting = False
        self._socket.close()                       # stops listening: new clients are refused at once
        for conn in list(self._connections):
            if conn.answered_at is None:
                conn.drop()
        deadline = self._loop.time() + CLOSE_GRACE
        while self._connections and self._loop.time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self._connections):
            conn.transport.abort()
        await asyncio.sleep(0)
        for sock in list(self._accepted):          # clients still in their TLS handshake
            sock.close()

    def close(self) -> None:
        """Stop accepting, drop connections still sending their heads, give answers being written
        :data:`CLOSE_GRACE` seconds, stop the thread."""
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        _SERVERS.discard(self)
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(CLOSE_GRACE + 2)
        except Exception as exc:  # noqa: BLE001 - closing never raises into the trainer
            self._loop_error(self._loop, {"exception": exc})
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=2)
            if not self._thread.is_alive():
                self._loop.close()
            self._socket.close()

    def _forget(self) -> None:
        """In a forked child: let go of this process's copies of the server's sockets, touching
        nothing the parent uses (no shutdown, no TLS close_notify, no lock, no loop call)."""
        self._closed = True
        _release_copies([self._socket.fileno(), *(sock.fileno() for sock in list(self._accepted))])


def _retrieve(task: asyncio.Task) -> None:
    """A connection's set-up task is done: a failed TLS handshake closed its socket already."""
    if not task.cancelled():
        task.exception()


def _release_copies(fds: list[int]) -> None:
    """Point each descriptor at /dev/null: this process's copy of the socket is closed (the peer
    sees nothing while the parent holds it), and the Python objects that still name the descriptor
    close /dev/null later, never an unrelated file."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:                    # out of descriptors in the child: close the copies instead
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        return
    try:
        for fd in fds:
            if fd >= 0:
                try:
                    os.dup2(null, fd)
                except OSError:
                    pass
    finally:
        os.close(null)

