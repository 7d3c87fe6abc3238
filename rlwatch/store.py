"""The embedded run store: SQLite in WAL mode, written off the training thread.

Tables:

- ``runs``: one row per run (start time, metadata JSON: config, framework, versions).
- ``steps``: one row per step; ``data`` is JSON ``{metric name: [[label..., value], ...]}`` holding
  every signal of the step (gauges, counter increments, histogram bucket counts).
- ``scalars``: a framework's own logged scalars per step (``Watch.log_scalars``).
- ``alerts``: alert events (firing / resolved) with labels, value and annotations.
- ``checkpoints``: which checkpoint directory belongs to which step.
- ``events``: notes about the run itself (data loss, errors), for the post-mortem.
- ``hack_examples``: a few episodes a reward-hack detector flagged (text truncated).

Writes go through a bounded queue to one writer thread, which commits after every batch; a
process killed at any moment leaves a store that opens and holds every committed step. Readers
may open the file while the run writes it (WAL). When the queue is full or a write fails, the
row is dropped and counted (``dropped``), never blocking or raising into the trainer.
"""

from __future__ import annotations

import json
import math
import os
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ._queues import wait_drained

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run TEXT PRIMARY KEY, started REAL, meta TEXT);
CREATE TABLE IF NOT EXISTS steps (run TEXT NOT NULL, step INTEGER NOT NULL, time REAL, data TEXT,
                                  PRIMARY KEY (run, step));
CREATE TABLE IF NOT EXISTS scalars (run TEXT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL,
                                    PRIMARY KEY (run, step, name));
CREATE TABLE IF NOT EXISTS alerts (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT, step INTEGER, time REAL,
                                   name TEXT, severity TEXT, state TEXT, labels TEXT, value REAL,
                                   annotations TEXT);
CREATE TABLE IF NOT EXISTS checkpoints (run TEXT, step INTEGER, path TEXT, time REAL,
                                        PRIMARY KEY (run, step, path));
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT, time REAL, kind TEXT,
                                   detail TEXT);
CREATE TABLE IF NOT EXISTS hack_examples (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT, step INTEGER, env TEXT,
                                          detector TEXT, reason TEXT, prompt TEXT, response TEXT, reward REAL);
"""

_STOP = object()


def encode_values(values: dict[str, dict[tuple[str, ...], float | None]]) -> str:
    """Step values as compact JSON; NaN/inf become null."""
    out: dict[str, list[list[Any]]] = {}
    for name, family in values.items():
        if name.startswith("_"):
            continue
        rows = []
        for labels, value in family.items():
            v = None if value is None or not math.isfinite(value) else value
            rows.append([*labels, v])
        out[name] = rows
    return json.dumps(out, separators=(",", ":"))


def decode_values(text: str) -> dict[str, dict[tuple[str, ...], float | None]]:
    raw = json.loads(text)
    return {name: {tuple(row[:-1]): row[-1] for row in rows} for name, rows in raw.items()}


class RunStore:
    """Asynchronous writer for one store file. ``submit_*`` never block; ``flush`` waits."""

    def __init__(self, path: str, on_error: Callable[[str, BaseException], None] | None = None,
                 max_queue: int = 4096) -> None:
        self.path = os.fspath(path)
        self._on_error = on_error or (lambda kind, exc: None)
        self.dropped = 0
        self.written_steps = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        self._conn = self._connect(self.path)    # raises on an unusable path: the caller disables the store
        self._thread = threading.Thread(target=self._run, name="rlwatch-store", daemon=True)
        self._thread.start()

    @staticmethod
    def _connect(path: str) -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=5.0, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(SCHEMA)
        return conn

    # --- submissions (training thread) --------------------------------------------------------

    def _put(self, item: tuple) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            self._on_error("queue_full", RuntimeError(f"store queue full ({self._queue.maxsize}); row dropped"))

    def submit_run(self, run: str, meta: dict[str, Any]) -> None:
        self._put(("INSERT OR REPLACE INTO runs VALUES (?, ?, ?)", (run, time.time(), json.dumps(meta, default=str))))

    def submit_step(self, run: str, step: int, values: dict[str, dict[tuple[str, ...], float | None]],
                    when: float | None = None) -> None:
        self._put(("INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?)",
                   (run, int(step), when or time.time(), encode_values(values)), "step"))

    def submit_scalars(self, run: str, step: int, mapping: dict[str, float]) -> None:
        rows = [(run, int(step), str(k), float(v)) for k, v in mapping.items()]
        if rows:
            self._put(("INSERT OR REPLACE INTO scalars VALUES (?, ?, ?, ?)", rows, "many"))

    def submit_alert(self, run: str, step: int | None, name: str, severity: str, state: str,
                     labels: dict[str, str], value: float | None, annotations: dict[str, str]) -> None:
        self._put(("INSERT INTO alerts (run, step, time, name, severity, state, labels, value, annotations) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (run, step, time.time(), name, severity, state, json.dumps(labels, sort_keys=True),
                    value if value is None or math.isfinite(value) else None, json.dumps(annotations))))

    def submit_checkpoint(self, run: str, step: int, path: str) -> None:
        self._put(("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?)", (run, int(step), os.fspath(path),
                                                                            time.time())))

    def submit_hack_examples(self, run: str, examples: list) -> None:
        rows = [(run, e.step, e.env, e.detector, e.reason, e.prompt, e.response, e.reward) for e in examples]
        if rows:
            self._put(("INSERT INTO hack_examples (run, step, env, detector, reason, prompt, response, reward) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows, "many"))

    def submit_event(self, run: str, kind: str, detail: str) -> None:
        self._put(("INSERT INTO events (run, time, kind, detail) VALUES (?, ?, ?, ?)",
                   (run, time.time(), kind, detail)))

    # --- writer thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < 256:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(x is _STOP for x in batch)
            self._write([x for x in batch if x is not _STOP])
            for _ in batch:
                self._queue.task_done()
            if stop:
                return

    def _write(self, batch: list[tuple]) -> None:
        if not batch:
            return
        try:
            self._conn.execute("BEGIN")
            steps = 0
            for sql, params, *mode in batch:
                if mode and mode[0] == "many":
                    self._conn.executemany(sql, params)
                else:
                    self._conn.execute(sql, params)
                    steps += bool(mode and mode[0] == "step")
            self._conn.execute("COMMIT")
            self.written_steps += steps
        except Exception as exc:  # noqa: BLE001 - disk full, read-only, locked: count and carry on
            try:
                self._conn.execute("ROLLBACK")
            except Exception:  # noqa: BLE001
                pass
            lost = sum(1 for _, _, *mode in batch if mode and mode[0] == "step")
            self.dropped += lost
            self._on_error("write", exc)

    # --- control ------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted row is written (or failed). False on timeout."""
        return wait_drained(self._queue, timeout, self._thread.is_alive)

    def close(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout=timeout)
        try:
            self._conn.close()
        except Exception:  # noqa: BLE001
            pass


@dataclass
class StepRow:
    step: int
    time: float
    values: dict[str, dict[tuple[str, ...], float | None]]

    def get(self, name: str, labels: tuple[str, ...] = ()) -> float | None:
        return self.values.get(name, {}).get(tuple(labels))


class StoreReader:
    """Read access to a store file, safe while a run is writing it."""

    def __init__(self, path: str) -> None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"no rlwatch store at {path}")
        self.path = path
        self._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        self._conn.row_factory = sqlite3.Row

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "StoreReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        return list(self._conn.execute(sql, tuple(params)))

    def runs(self) -> list[str]:
        return [r["run"] for r in self._rows("SELECT run FROM runs ORDER BY started")] or \
            [r["run"] for r in self._rows("SELECT DISTINCT run FROM steps")]

    def meta(self, run: str) -> dict[str, Any]:
        rows = self._rows("SELECT meta FROM runs WHERE run = ?", (run,))
        return json.loads(rows[0]["meta"]) if rows else {}

    def steps(self, run: str) -> list[StepRow]:
        return [StepRow(r["step"], r["time"], decode_values(r["data"]))
                for r in self._rows("SELECT step, time, data FROM steps WHERE run = ? ORDER BY step", (run,))]

    def series(self, run: str, name: str, labels: tuple[str, ...] = ()) -> list[tuple[int, float]]:
        """(step, value) pairs of one signal, skipping steps where it is absent."""
        out = []
        for row in self.steps(run):
            value = row.get(name, labels)
            if value is not None:
                out.append((row.step, value))
        return out

    def scalars(self, run: str) -> dict[str, list[tuple[int, float]]]:
        out: dict[str, list[tuple[int, float]]] = {}
        for r in self._rows("SELECT step, name, value FROM scalars WHERE run = ? ORDER BY step", (run,)):
            out.setdefault(r["name"], []).append((r["step"], r["value"]))
        return out

    def alerts(self, run: str) -> list[dict[str, Any]]:
        return [dict(step=r["step"], time=r["time"], name=r["name"], severity=r["severity"], state=r["state"],
                     labels=json.loads(r["labels"] or "{}"), value=r["value"],
                     annotations=json.loads(r["annotations"] or "{}"))
                for r in self._rows("SELECT * FROM alerts WHERE run = ? ORDER BY id", (run,))]

    def checkpoints(self, run: str) -> list[tuple[int, str]]:
        return [(r["step"], r["path"]) for r in
                self._rows("SELECT step, path FROM checkpoints WHERE run = ? ORDER BY step", (run,))]

    def hack_examples(self, run: str) -> list[dict[str, Any]]:
        return [dict(step=r["step"], env=r["env"], detector=r["detector"], reason=r["reason"], prompt=r["prompt"],
                     response=r["response"], reward=r["reward"])
                for r in self._rows("SELECT * FROM hack_examples WHERE run = ? ORDER BY id", (run,))]

    def events(self, run: str) -> list[dict[str, Any]]:
        return [dict(time=r["time"], kind=r["kind"], detail=r["detail"])
                for r in self._rows("SELECT * FROM events WHERE run = ? ORDER BY id", (run,))]
