"""`rlwatch postmortem` on a long run: wall time and peak RSS of the command on a synthetic store.

The store has the run store's schema (:data:`rlwatch.runs.store.SCHEMA`) and step rows as a Watch writes
them: one real step row (every signal of a step, ~4.5 KB of JSON) recorded by a Watch, repeated with
the post-mortem's signals moving through a collapse (the mismatch and the lag rise at 60% of the run,
the reward falls at 70%), an attempt, a critical alert and a checkpoint every 1% of the run.

    python bench/bench_postmortem.py                         # 1,000,000 steps, store kept in /tmp
    python bench/bench_postmortem.py --steps 200000 --store /tmp/pm-200k.db

The store is built once (minutes for 1M steps: ~4.6 GB) and reused while its step count matches.
The command runs in a subprocess (``python -m rlwatch.ops.cli postmortem STORE --out DIR``); its wall
time and peak RSS (``wait4``'s ``ru_maxrss``) are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = "long-run"
#: Unlabelled signals given a level per step (before the change, after it, the change's share of the run).
MOVING = {
    "reward_mean": (0.6, 0.1, 0.7), "mismatch_kl_k3": (0.001, 0.05, 0.6),
    "mismatch_abs_log_ratio_mean": (0.02, 0.3, 0.6), "mismatch_abs_log_ratio_p99": (0.2, 1.5, 0.6),
    "version_lag_max": (1.0, 8.0, 0.6), "version_lag_mean": (0.5, 4.0, 0.6), "is_ess_ratio": (0.95, 0.5, 0.6),
    "response_length_mean": (200.0, 190.0, 0.7), "truncated_ratio": (0.01, 0.02, 0.7),
}


def template_row() -> str:
    """One step row as a Watch writes it, with ``%(name)r``-style slots for :data:`MOVING` and the step."""
    import torch

    import rlwatch

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "one.db")
        with rlwatch.Watch(run="template", port=None, store=path) as watch:
            g = torch.Generator().manual_seed(0)
            B, T = 16, 32
            lengths = torch.randint(1, T + 1, (B,), generator=g)
            sampler = -torch.rand(B, T, generator=g) * 3
            for step in range(3):
                watch.observe(step, mask=torch.arange(T)[None, :] < lengths[:, None], sampler_logp=sampler,
                              trainer_logp=sampler + 0.05 * torch.randn(B, T, generator=g),
                              token_version=torch.full((B, T), 9), trainer_version=10,
                              rewards=torch.randint(0, 2, (B,), generator=g).float(), group_ids=torch.arange(B) // 4,
                              truncated=lengths == T, env=["math", "code"] * (B // 2))
        with sqlite3.connect(path) as conn:
            data = json.loads(conn.execute("SELECT data FROM steps ORDER BY step DESC LIMIT 1").fetchone()[0])
    for name in [*MOVING, "step", "trainer_version"]:
        data[name] = [[f"@@{name}@@"]]
    text = json.dumps(data, separators=(",", ":")).replace("%", "%%")
    for name in MOVING:
        text = text.replace(f'"@@{name}@@"', f"%({name}).6g")
    return text.replace('"@@step@@"', "%(step)d").replace('"@@trainer_version@@"', "%(step)d")


def _levels(step: int, steps: int) -> dict[str, float]:
    noise = ((step * 2654435761) % 1000) / 1000.0 - 0.5            # deterministic, uniform in [-0.5, 0.5)
    out: dict[str, float] = {"step": step}
    for name, (before, after, at) in MOVING.items():
        level = before if step < at * steps else after
        out[name] = level * (1.0 + 0.1 * noise)
    return out


def build_store(path: str | Path, steps: int, batch: int = 5000) -> Path:
    """Write a store of ``steps`` steps of run :data:`RUN` at ``path`` (replaced if there)."""
    from rlwatch.runs.store import SCHEMA

    path = Path(path)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    template = template_row()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    conn.executescript(SCHEMA)
    start, attempt = 1.7e9, "20260101T000000-1-abcdef"
    conn.execute("INSERT INTO runs VALUES (?, ?, ?)", (RUN, start, json.dumps({"framework": "synthetic"})))
    conn.execute("INSERT INTO attempts VALUES (?, ?, ?, ?, ?)", (attempt, RUN, start, 1, "bench"))
    for first in range(0, steps, batch):
        rows = [(RUN, s, start + s, template % _levels(s, steps), attempt)
                for s in range(first, min(first + batch, steps))]
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO steps (run, step, time, data, attempt) VALUES (?, ?, ?, ?, ?)", rows)
        conn.execute("COMMIT")
    every = max(1, steps // 100)
    conn.executemany("INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                     [(RUN, s, f"/ckpt/checkpoint-{s}", start + s, attempt) for s in range(every - 1, steps, every)])
    spike = int(0.6 * steps) + 20
    conn.execute("INSERT INTO alerts (run, step, time, name, severity, state, labels, value, annotations, attempt) "
                 "VALUES (?, ?, ?, 'RLWatchKLSpike', 'critical', 'firing', '{}', 0.05, '{}', ?)",
                 (RUN, spike, start + spike, attempt))
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path


def store_steps(path: Path) -> int:
    """The number of steps of :data:`RUN` in the store at ``path`` (0 when there is none)."""
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            return conn.execute("SELECT MAX(step) + 1 FROM steps WHERE run = ?", (RUN,)).fetchone()[0] or 0
    except sqlite3.Error:
        return 0


def measure(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int, str]:
    """Run ``command``: (wall seconds, peak RSS in MiB, exit status, output); its CPU seconds in
    ``measure.cpu``."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    measure.cpu = usage.ru_utime + usage.ru_stime
    return time.monotonic() - started, usage.ru_maxrss / 1024, proc.returncode, output.decode(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--store", help="where the store is kept (default /tmp/rlwatch-bench-postmortem-STEPS.db)")
    parser.add_argument("--rebuild", action="store_true", help="build the store even where one of the size is there")
    args = parser.parse_args()
    store = Path(args.store or f"{tempfile.gettempdir()}/rlwatch-bench-postmortem-{args.steps}.db")
    if args.rebuild or store_steps(store) != args.steps:
        began = time.monotonic()
        build_store(store, args.steps)
        print(f"built {store} ({args.steps:,} steps, {store.stat().st_size / 2**20:,.0f} MiB) "
              f"in {time.monotonic() - began:.0f} s")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    with tempfile.TemporaryDirectory() as out:
        wall, rss, rc, output = measure([sys.executable, "-m", "rlwatch", "postmortem", str(store),
                                         "--out", out], env)
        plots = len(list(Path(out).glob("*.png")))
    print(output[-3000:])
    print(f"rlwatch postmortem {store} --out DIR: {args.steps:,} steps "
          f"({store.stat().st_size / 2**20:,.0f} MiB), wall {wall:.1f} s (CPU {measure.cpu:.1f} s), "
          f"peak RSS {rss:,.0f} MiB, "
          f"exit {rc}, {plots} plots")
    return rc


if __name__ == "__main__":
    sys.exit(main())
