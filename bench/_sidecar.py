"""Experiment for the TRL overhead question (issue 3): rlwatch's per-step work in another process.

``attach(watch, **options)`` starts a child process (spawn) holding a full ``Watch`` built from
``options`` (its /metrics endpoint, run store, alerts), and re-points the given Watch's ``observe``
and ``log_scalars`` at it: the training thread then only captures and assembles the step (as
always) and pickles its fields down a pipe; the signals, exporters, store and alerts run in the
child, on whatever core is free. Bench-only: it is not a supported mode of ``Watch`` (guards and
``on_alert`` callbacks would run in the wrong process), only a measurement of what such a mode
would cost the trainer.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import numpy as np
import torch


def _to_host(value: Any) -> Any:
    return value.detach().cpu().numpy().copy() if isinstance(value, torch.Tensor) else value


def _from_host(value: Any) -> Any:
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def _serve(conn: Any, options: dict) -> None:
    torch.set_num_threads(1)
    from rlwatch.hook.watch import Watch

    watch = Watch(**options)
    busy = 0.0
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            start = time.process_time()
            method, args, fields = message
            getattr(watch, method)(*args, **{k: _from_host(v) for k, v in fields.items()})
            busy += time.process_time() - start
    finally:
        watch.close()
        conn.send(busy)
        conn.close()


class Sidecar:
    """The child process and the parent's end of its pipe."""

    def __init__(self, options: dict) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_conn, options), daemon=True,
                                       name="rlwatch-sidecar")
        self.process.start()
        child_conn.close()
        self.busy_seconds = 0.0

    def send(self, method: str, *args: Any, **fields: Any) -> None:
        self.conn.send((method, args, {k: _to_host(v) for k, v in fields.items()}))

    def close(self) -> None:
        """Stop the child after it has handled everything sent; keep its CPU time."""
        self.conn.send(None)
        self.busy_seconds = self.conn.recv()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def attach(watch: Any, **options: Any) -> Sidecar:
    sidecar = Sidecar(options)
    watch.observe = lambda step, **fields: sidecar.send("observe", step, **fields)
    watch.log_scalars = lambda step, scalars: sidecar.send("log_scalars", step, scalars)
    return sidecar
