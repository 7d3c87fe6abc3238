"""The reward-hack detector process: ``python -m rlwatch.hacks.worker``.

A plain child interpreter, started with ``subprocess`` rather than ``multiprocessing`` so that it
never re-imports the user's training script (``spawn`` re-runs ``__main__``, which would start a
second training in a script without a ``__main__`` guard). It reads length-prefixed pickled
messages on stdin: first ``(detectors, checkers, max_examples)``, then ``(step, episodes, env)``
batches, and writes one pickled :class:`~rlwatch.hacks.judge.BatchResult` per batch on stdout.
It exits at end of input, so it never outlives its parent.
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct("!I")


def write_message(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    """The next message, or raises EOFError at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def main() -> None:
    from . import builtin
    from .judge import judge_batch

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr                       # a detector that prints must not corrupt the protocol
    detectors, checkers, max_examples = read_message(stdin)
    builtin._CHECKERS.update(checkers)
    while True:
        try:
            step, episodes, env = read_message(stdin)
        except EOFError:
            return
        write_message(stdout, judge_batch(detectors, step, episodes, env, max_examples=max_examples))


if __name__ == "__main__":
    main()
