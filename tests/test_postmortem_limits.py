"""`rlwatch postmortem --prometheus` against a real HTTP server on 127.0.0.1 that sends valid but large
answers (issue 37, item 13): one over the size cap is refused with one line (announced by its
Content-Length or not), and the deadline bounds the whole command, the parsing of a large answer
included (before, a 200 MB answer ran 72 s past `--deadline 60`)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlwatch.postmortem.prometheus import MAX_BODY_BYTES

HEAD = b'{"status":"success","data":{"resultType":"matrix","result":[{"metric":{"run":"x","instance":"h:1"},"values":['
TAIL = b'[1700000000.000,"1"]]}]}}'


def points(count: int, start: float = 1.7e9) -> bytes:
    """``count`` samples of a matrix' values, each followed by a comma."""
    return b"".join(b'[%.3f,"1"],' % (start + i * 0.001) for i in range(count))


class LargeAnswers(BaseHTTPRequestHandler):
    """Answers every query with one valid matrix of ``server.size`` bytes, in 1 MiB writes spread over
    ``server.seconds``; with its Content-Length where ``server.announce``."""

    def do_GET(self):  # noqa: N802
        chunk = self.server.chunk
        writes = max(1, (self.server.size - len(HEAD) - len(TAIL)) // len(chunk))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.server.announce:
            self.send_header("Content-Length", str(len(HEAD) + writes * len(chunk) + len(TAIL)))
        self.end_headers()
        try:
            self.wfile.write(HEAD)
            for _ in range(writes):
                self.wfile.write(chunk)
                time.sleep(self.server.seconds / writes)
            self.wfile.write(TAIL)
        except OSError:                     # the client stopped reading: done
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def large_prometheus():
    server = ThreadingHTTPServer(("127.0.0.1", 0), LargeAnswers)
    server.daemon_threads = True
    server.chunk = points(50_000)[: 2 ** 20 // 21 * 21]            # ~1 MiB of whole samples
    server.chunk = server.chunk[: server.chunk.rindex(b",") + 1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.fixture
def inproc(capsys):
    from rlwatch.ops.cli import main

    def run(*args: str) -> tuple[int, str, str, float]:
        start = time.monotonic()
        rc = main(["postmortem", *args])
        return (rc, *capsys.readouterr(), time.monotonic() - start)
    return run


@pytest.mark.parametrize("announce", [True, False], ids=["content-length", "close-delimited"])
def test_an_answer_over_the_size_cap_is_refused_with_one_line(announce, large_prometheus, inproc):
    """48 MiB (under the former 256 MiB cap, which parsed it into ~0.5 GB), sent within a second."""
    large_prometheus.size, large_prometheus.seconds, large_prometheus.announce = 48 * 2 ** 20, 1.0, announce
    url = f"http://127.0.0.1:{large_prometheus.server_address[1]}"
    rc, out, err, elapsed = inproc("--prometheus", url, "--run", "x", "--deadline", "30")
    assert rc == 1 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith(f"rlwatch postmortem: Prometheus at {url}: answer of "), err
    assert f"over the {MAX_BODY_BYTES >> 20} MiB size cap; stopped" in err, err
    assert elapsed < 10, elapsed


def test_the_deadline_bounds_the_parsing_of_a_large_valid_answer(large_prometheus, inproc):
    """A valid 24 MiB answer (under the cap) trickled over 1.5 s of a 2.5 s deadline: parsing and checking
    it takes several seconds, so the command stops at the deadline instead of running past it."""
    large_prometheus.size, large_prometheus.seconds, large_prometheus.announce = 24 * 2 ** 20, 1.5, True
    url = f"http://127.0.0.1:{large_prometheus.server_address[1]}"
    rc, out, err, elapsed = inproc("--prometheus", url, "--run", "x", "--deadline", "2.5")
    assert rc == 1 and out == "", (out, err)
    assert err.count("\n") == 1 and "2.5 s deadline; stopped (raise --deadline)" in err, err
    assert elapsed < 2.5 + 1.5, elapsed
