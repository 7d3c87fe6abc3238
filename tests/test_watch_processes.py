"""Watch across processes: the store read while the run writes, every completed step surviving a
SIGKILL (mid-run, and right after ``flush()`` or a checkpoint), and several ranks on one node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import rlwatch
from rlwatch.runs.store import StoreReader

from .conftest import ROOT, free_consecutive_ports, make_step


def test_store_is_readable_while_the_run_writes(tmp_path):
    path = str(tmp_path / "live.db")
    with rlwatch.Watch(run="live", port=None, store=path) as watch:
        for i in range(5):
            watch.observe(i, **make_step(seed=i))
        watch.flush()
        with StoreReader(path) as reader:
            assert [r.step for r in reader.steps("live")] == [0, 1, 2, 3, 4]
        watch.record_checkpoint(4, "/ckpt/checkpoint-4")
        watch.record_checkpoint(5, "out/checkpoint-5")              # relative: stored absolute
        watch.record_checkpoint(6, "s3://bucket/run/checkpoint-6")  # a URL: kept as given
        watch.log_scalars(4, {"loss": 0.5})
        watch.flush()
        with StoreReader(path) as reader:
            assert reader.checkpoints("live") == [(4, "/ckpt/checkpoint-4"),
                                                  (5, os.path.join(os.getcwd(), "out", "checkpoint-5")),
                                                  (6, "s3://bucket/run/checkpoint-6")]
            assert reader.scalars("live") == {"loss": [(4, 0.5)]}


KILL_CHILD = textwrap.dedent("""
    import sys, time, torch, rlwatch
    sys.path.insert(0, {root!r})
    from tests.conftest import make_step
    watch = rlwatch.Watch(run="killed", port=None, store={path!r})
    for step in range(100000):
        watch.observe(step, **make_step(B=8, T=16, seed=step))
        watch.flush()
        print(step, flush=True)
        time.sleep(0.01)
""")


def test_sigkill_mid_run_leaves_every_completed_step(tmp_path):
    import queue
    import time

    path = str(tmp_path / "killed.db")
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD.format(root=str(ROOT), path=path)],
                             stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:                      # a hung child must not block the suite: read on a thread
        for line in child.stdout:
            lines.put(line)
        lines.put(None)                      # EOF: the child exited or closed its output

    reader_thread = threading.Thread(target=read, daemon=True)
    reader_thread.start()
    last = -1
    try:
        deadline = time.monotonic() + 120
        while last < 30:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the child reported only {last + 1} steps in 120 s")
            assert line is not None, f"the child exited (rc={child.poll()}) after only {last + 1} steps"
            assert int(line) == last + 1, line
            last = int(line)
        assert child.poll() is None, "the child must still be running when it is killed"
    finally:
        if child.poll() is None:                         # not yet reaped: its PID is still its own
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        reader_thread.join(timeout=10)                   # EOF once the child is gone
        child.stdout.close()
    with StoreReader(path) as reader:
        steps = [r.step for r in reader.steps("killed")]
    assert len(steps) >= last + 1 >= 31                  # every step the child reported before the kill
    assert steps == list(range(len(steps)))              # contiguous: nothing half-written


_KILL_AFTER = textwrap.dedent("""
    import os, signal, sys
    import rlwatch
    from tests.conftest import make_step
    path, steps, background, point = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    watch = rlwatch.Watch(run="durable", port=None, store=path, alerts=False, background=background)
    for i in range(steps):
        watch.observe(i, **make_step(B=4, T=8, seed=i))
    if point == "checkpoint":
        watch.record_checkpoint(steps - 1, "/tmp/ckpt")
    else:
        assert watch.flush()
    os.kill(os.getpid(), signal.SIGKILL)         # right after: nothing else runs
""")


@pytest.mark.parametrize("point,background", [("checkpoint", False), ("checkpoint", True), ("flush", True)])
def test_steps_before_flush_or_a_checkpoint_survive_sigkill_right_after(tmp_path, point, background):
    """What observe promises: a step is in the store once flush() returned True, and
    record_checkpoint() flushes; a SIGKILL right after loses none of those steps."""
    import sqlite3

    root = Path(__file__).resolve().parents[1]
    for trial, steps in enumerate((13,)):
        path = str(tmp_path / f"d{trial}.db")
        proc = subprocess.run([sys.executable, "-c", _KILL_AFTER, path, str(steps), str(int(background)), point],
                              cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        with sqlite3.connect(path) as conn:
            stored = [r[0] for r in conn.execute("SELECT step FROM steps WHERE run = 'durable' ORDER BY step")]
            checkpoints = conn.execute("SELECT step FROM checkpoints").fetchall()
        assert stored == list(range(steps)), (trial, stored)
        if point == "checkpoint":
            assert checkpoints == [(steps - 1,)]


RANK_CHILD = textwrap.dedent("""
    import os, sys, json, urllib.request, rlwatch, torch
    sys.path.insert(0, {root!r})
    from tests.conftest import make_step
    w = rlwatch.Watch(run="ddp", port={port}, store=None, all_ranks={all_ranks})
    w.observe(0, **make_step())
    body = urllib.request.urlopen(w.url).read().decode() if w.url else ""
    print(json.dumps(dict(rank=w.rank, active=w.active, run=w.run, url=w.url, has=("rlwatch_steps_total" in body))))
    w.close()
""")


@pytest.mark.slow
@pytest.mark.parametrize("all_ranks", [False, True])
def test_several_ranks_on_one_node(all_ranks):
    port = free_consecutive_ports(2)                 # rank N serves on port + N
    results = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        out = subprocess.run([sys.executable, "-c", RANK_CHILD.format(root=str(ROOT), port=port,
                                                                      all_ranks=all_ranks)],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        results.append(json.loads(out.stdout.strip().splitlines()[-1]) | {"stderr": out.stderr[-2000:]})
    assert results[0]["active"] and results[0]["has"], results[0]
    if all_ranks:
        assert results[1]["active"] and results[1]["has"], results[1]
        assert results[1]["run"] == "ddp-rank1" and results[1]["url"].endswith(f":{port + 1}/metrics")
    else:
        assert not results[1]["active"] and results[1]["url"] is None
