"""The static runbook server ``rlwatch up`` starts: the files of one directory over HTTP, with an
idle timeout per connection and a bounded number of threads (``python -m http.server`` has
neither: every idle connection holds a thread forever).

    python -m rlwatch.runs.runbook_server PORT --bind ADDR --directory DIR
"""

from __future__ import annotations

import argparse
import functools
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

#: Seconds a connection may stay silent (before its request, or between two requests) before it is cut.
IDLE_TIMEOUT_S = 5.0
#: Connections served at once (one thread each); beyond, a newcomer is answered 503 and closed.
MAX_THREADS = 32


class _Handler(SimpleHTTPRequestHandler):
    timeout = IDLE_TIMEOUT_S          # the socket's timeout: a silent client is cut, its thread ends

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        pass


class RunbookServer(ThreadingHTTPServer):
    """A threading HTTP server with at most ``max_threads`` connections served at once."""

    daemon_threads = True
    request_queue_size = 128          # socketserver's 5 would leave a burst of clients retrying their SYN

    def __init__(self, address: tuple[str, int], handler: type, max_threads: int = MAX_THREADS) -> None:
        self.slots = threading.BoundedSemaphore(max_threads)
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        if not self.slots.acquire(blocking=False):         # every thread busy: no new one
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--directory", required=True)
    args = parser.parse_args(argv)
    handler = functools.partial(_Handler, directory=args.directory)
    if ":" in args.bind:
        RunbookServer.address_family = socket.AF_INET6
    with RunbookServer((args.bind, args.port), handler) as server:
        server.serve_forever()


if __name__ == "__main__":
    main()
