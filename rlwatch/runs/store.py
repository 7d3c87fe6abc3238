"""The embedded run store: SQLite in WAL mode, written off the training thread.

Tables:

- ``runs``: one row per run (start time, metadata JSON: config, framework, versions).
- ``steps``: one row per step, the latest observation of it; ``data`` is JSON ``{metric name:
  [[label..., value], ...]}`` holding every signal of the step (gauges, counter increments,
  histogram bucket counts); ``attempt`` names the process that wrote it (``attempts.id``).
- ``step_history``: every earlier observation of a step that was observed again (a resumed run,
  a re-run segment, two processes writing the same run), moved there with the time it was
  replaced: nothing observed is overwritten. Counted as conflicts (``step_conflicts``).
- ``attempts``: one row per process that wrote a run (id, run, start time, pid, host).
- ``scalars``: a framework's own logged scalars per step (``Watch.log_scalars``).
- ``alerts``: alert events (firing / resolved) with labels, value, annotations and the attempt
  that raised them.
- ``checkpoints``: which checkpoint directory belongs to which step, and the attempt that saved it.
- ``events``: notes about the run itself (data loss, errors), for the post-mortem.
- ``hack_examples``: a few episodes a reward-hack detector flagged (text truncated).
- ``hack_counts``: episodes judged and flagged per step, environment and detector, keyed by the step
  the episodes came from (a detector's verdicts arrive later, with whichever step collects them; the
  step rows hold that collected view, as Prometheus sees it; the post-mortem reads this table).

Writes go through a bounded queue to one writer thread, which commits after every batch; a
process killed at any moment leaves a store that opens and holds every committed step. Readers
may open the file while the run writes it (WAL), with :class:`~rlwatch.runs.store_reader.StoreReader`
(re-exported here). Every value is converted at submission (0-d tensors and numpy scalars to
numbers, strings made encodable). A batch that fails is written again row by row, so that a row
the database refuses costs that row only; a database locked by another process is retried with
backoff for up to ``retry_seconds`` (the trainer never waits: the queue absorbs the steps
meanwhile). When the queue is full or a row finally fails, the row is dropped and counted
(``dropped``), never blocking or raising into the trainer. ``flush()`` returning True means every
row submitted before it is committed (and the WAL synced).
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

from ..core.queues import wait_drained
from .store_reader import StepRow, StoreReader, decode_values  # noqa: F401 - read side, public here

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run TEXT PRIMARY KEY, started REAL, meta TEXT);
CREATE TABLE IF NOT EXISTS steps (run TEXT NOT NULL, step INTEGER NOT NULL, time REAL, data TEXT, attempt TEXT,
                                  PRIMARY KEY (run, step));
CREATE TABLE IF NOT EXISTS scalars (run TEXT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL,
                                    PRIMARY KEY (run, step, name));
CREATE TABLE IF NOT EXISTS alerts (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT, step INTEGER, time REAL,
                                   name TEXT, severity TEXT, state TEXT, labels TEXT, value REAL,
                                   annotations TEXT, attempt TEXT);
CREATE TABLE IF NOT EXISTS checkpoints (run TEXT, step INTEGER, path TEXT, time REAL, attempt TEXT,
                                        PRIMARY KEY (run, step, path));
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT, time REAL, kind TEXT,
                                   detail TEXT);
CREATE TABLE IF NOT EXISTS step_history (run TEXT NOT NULL, step INTEGER NOT NULL, time REAL, data TEXT,
                                         attempt TEXT, replaced REAL);
CREATE INDEX IF NOT EXISTS step_history_run_step ON step_history (run, step);
CREATE TABLE IF NOT EXISTS attempts (id TEXT PRIMARY KEY, run TEXT, started REAL, pid INTEGER, host TEXT);
CREATE TABLE IF NOT EXISTS hack_examples (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT, step INTEGER, env TEXT,
                                          detector TEXT, reason TEXT, prompt TEXT, response TEXT, reward REAL);
CREATE TABLE IF NOT EXISTS hack_counts (run TEXT NOT NULL, step INTEGER NOT NULL, env TEXT NOT NULL,
                                        detector TEXT NOT NULL, judged REAL, hacked REAL,
                                        PRIMARY KEY (run, step, env, detector));
"""

#: Tables whose rows name the attempt (``attempts.id``) that wrote them; older stores gain the column.
ATTEMPT_TABLES = ("steps", "alerts", "checkpoints")
_STOP = object()
_SYNC = ("PRAGMA wal_checkpoint(PASSIVE)", (), "sync")     # syncs the WAL: flush() is durable


def bindable(value: Any) -> Any:
    """A value SQLite can bind: None, int, float, encodable str or bytes. 0-d tensors and numpy
    scalars become numbers, bools ints, paths and other objects encodable strings."""
    from ..core.record import clean_text

    if isinstance(value, int) and not -2 ** 63 <= value < 2 ** 63:
        return float(value)                    # SQLite integers are 64-bit
    if value is None or isinstance(value, (int, float, bytes)):
        return int(value) if isinstance(value, bool) else value
    if isinstance(value, str):
        return clean_text(value)
    if callable(getattr(value, "item", None)):         # 0-d tensors, numpy scalars
        try:
            number = value.item()
        except Exception:  # noqa: BLE001 - several elements: stored as text below
            number = None
        if isinstance(number, bool):
            return int(number)
        if isinstance(number, (int, float)):
            return bindable(number)
    if isinstance(value, os.PathLike):
        return clean_text(os.fsdecode(value))
    return clean_text(value)


def _finite(value: Any) -> float | None:
    if type(value) is float:                     # the common case, on the training thread
        return value if math.isfinite(value) else None
    number = bindable(value)
    if isinstance(number, (int, float)) and math.isfinite(number):
        return float(number)
    return None


def _locked(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def encode_values(values: dict[str, dict[tuple[str, ...], float | None]]) -> str:
    """Step values as compact JSON; NaN/inf become null."""
    out: dict[str, list[list[Any]]] = {}
    for name, family in values.items():
        if name.startswith("_"):
            continue
        rows = []
        for labels, value in family.items():
            rows.append([*labels, _finite(value)])
        out[name] = rows
    return json.dumps(out, separators=(",", ":"), default=str)


@dataclass
class StoreCounts:
    """What happened to the submitted rows, counted by the submitting and the writing side."""

    dropped: int = 0              # steps lost (queue full, refused after close, or a failed write)
    dropped_rows: int = 0         # rows of any table lost
    written_steps: int = 0
    step_conflicts: int = 0       # steps observed again: the earlier row moved to step_history
    retries: int = 0              # batch writes retried because another connection held the lock


class RunStore:
    """Asynchronous writer for one store file. ``submit_*`` never block; ``flush`` waits. The rows
    go through a bounded queue to a :class:`_StoreWriter` on its own thread."""

    def __init__(self, path: str, on_error: Callable[[str, BaseException], None] | None = None,
                 max_queue: int = 4096, busy_timeout: float = 5.0, retry_seconds: float = 120.0) -> None:
        self.path = os.fspath(path)
        self._on_error = on_error or (lambda kind, exc: None)
        self.counts = StoreCounts()
        self.attempt = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"
        self._closed = False
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        conn = _connect(self.path, busy_timeout)           # raises on an unusable path: no store
        self._writer = _StoreWriter(conn, self._queue, self.counts, self.attempt, retry_seconds, self._on_error)
        self._thread = threading.Thread(target=self._writer.run, name="rlwatch-store", daemon=True)
        self._thread.start()

    dropped = property(lambda self: self.counts.dropped)
    dropped_rows = property(lambda self: self.counts.dropped_rows)
    written_steps = property(lambda self: self.counts.written_steps)
    step_conflicts = property(lambda self: self.counts.step_conflicts)
    retries = property(lambda self: self.counts.retries)
    retry_seconds = property(lambda self: self._writer.retry_seconds,
                             lambda self, seconds: setattr(self._writer, "retry_seconds", seconds))

    # --- submissions (training thread) --------------------------------------------------------

    def _put(self, item: tuple) -> None:
        steps = sum(1 for _ in _step_rows(item))
        if self._closed:
            self._lose(item, "closed", RuntimeError("store closed; row refused"))
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._lose(item, "queue_full", RuntimeError(f"store queue full ({self._queue.maxsize}); "
                                                        f"{'step' if steps else 'row'} dropped"))

    def _lose(self, item: tuple, kind: str, exc: BaseException) -> None:
        rows = len(item[1]) if len(item) > 2 and item[2] == "many" else 1
        self.counts.dropped += sum(1 for _ in _step_rows(item))
        self.counts.dropped_rows += rows
        self._on_error(kind, exc)

    def submit_run(self, run: str, meta: dict[str, Any]) -> None:
        import socket

        run = bindable(run)
        self._put(("INSERT OR REPLACE INTO runs VALUES (?, ?, ?)", (run, time.time(), json.dumps(meta, default=str))))
        self._put(("INSERT OR REPLACE INTO attempts VALUES (?, ?, ?, ?, ?)",
                   (self.attempt, run, time.time(), os.getpid(), bindable(socket.gethostname()))))

    def submit_step(self, run: str, step: int, values: dict[str, dict[tuple[str, ...], float | None]],
                    when: float | None = None, replace: bool = False) -> None:
        """Store one step's row. ``replace``: the same process's row of this step, completed (the
        trainer's logged scalars joined to it), replaces the earlier one with no conflict counted."""
        self._put(("step", (bindable(run), bindable(int(step)), float(when or time.time()), encode_values(values),
                            self.attempt), "step_replace" if replace else "step"))

    def submit_scalars(self, run: str, step: int, mapping: dict[str, float]) -> None:
        run = bindable(run)
        rows = [(run, bindable(int(step)), bindable(str(k)), _finite(v)) for k, v in mapping.items()]
        if rows:
            self._put(("INSERT OR REPLACE INTO scalars VALUES (?, ?, ?, ?)", rows, "many"))

    def submit_alert(self, run: str, step: int | None, name: str, severity: str, state: str,
                     labels: dict[str, str], value: float | None, annotations: dict[str, str]) -> None:
        self._put(("INSERT INTO alerts (run, step, time, name, severity, state, labels, value, annotations, "
                   "attempt) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (bindable(run), None if step is None else int(step), time.time(), bindable(name),
                    bindable(severity), bindable(state), json.dumps(labels, sort_keys=True, default=str),
                    _finite(value), json.dumps(annotations, default=str), self.attempt)))

    def submit_checkpoint(self, run: str, step: int, path: str) -> None:
        self._put(("INSERT OR REPLACE INTO checkpoints (run, step, path, time, attempt) VALUES (?, ?, ?, ?, ?)",
                   (bindable(run), bindable(int(step)), bindable(path), time.time(), self.attempt)))

    def submit_hack_examples(self, run: str, examples: list) -> None:
        run = bindable(run)
        rows = [(run, None if e.step is None else int(e.step), bindable(e.env), bindable(e.detector),
                 bindable(e.reason), bindable(e.prompt), bindable(e.response), _finite(e.reward))
                for e in examples]
        if rows:
            self._put(("INSERT INTO hack_examples (run, step, env, detector, reason, prompt, response, reward) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows, "many"))

    def submit_hack_counts(self, run: str, step: int, judged: dict[tuple[str, ...], float],
                           hacked: dict[tuple[str, ...], float]) -> None:
        """Add episodes judged / flagged per (env, detector) to the counts of ``step``, the step the
        episodes came from (verdicts of one step may arrive in several parts)."""
        run = bindable(run)
        rows = [(run, bindable(int(step)), bindable(str(key[0])), bindable(str(key[1])), _finite(n) or 0.0,
                 _finite(hacked.get(key)) or 0.0) for key, n in judged.items() if len(key) == 2]
        if rows:
            self._put(("INSERT INTO hack_counts (run, step, env, detector, judged, hacked) VALUES (?, ?, ?, ?, ?, ?) "
                       "ON CONFLICT (run, step, env, detector) DO UPDATE SET judged = judged + excluded.judged, "
                       "hacked = hacked + excluded.hacked", rows, "many"))

    def submit_event(self, run: str, kind: str, detail: str) -> None:
        self._put(("INSERT INTO events (run, time, kind, detail) VALUES (?, ?, ?, ?)",
                   (bindable(run), time.time(), bindable(kind), bindable(detail))))

    # --- control ------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every row submitted before the call is committed and the WAL synced (or
        failed and counted). True means a process killed afterwards keeps those rows; False on
        timeout (the writer is behind, e.g. retrying a locked database)."""
        if self._closed or not self._thread.is_alive():
            return not self._thread.is_alive() and self._queue.unfinished_tasks == 0
        try:
            self._queue.put(_SYNC, timeout=timeout)
        except queue.Full:
            return False
        return wait_drained(self._queue, timeout, self._thread.is_alive)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout`` s) and close; rows submitted later are refused
        and counted."""
        self._closed = True
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout=timeout)
        try:
            self._writer.conn.close()
        except Exception:  # noqa: BLE001
            pass


def _connect(path: str, busy_timeout: float = 5.0) -> sqlite3.Connection:
    """A WAL-mode connection with the schema in place (a store from before ``attempt`` gets the columns)."""
    conn = sqlite3.connect(path, timeout=busy_timeout, check_same_thread=False, isolation_level=None)
    deadline = time.monotonic() + 30.0
    while True:                       # another process may hold the lock while we set up
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(SCHEMA)
            for table in ATTEMPT_TABLES:          # a store written before attempts existed
                if "attempt" not in {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN attempt TEXT")
            return conn
        except sqlite3.OperationalError as exc:
            if not _locked(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class _StoreWriter:
    """The writer thread: takes batches of rows off ``items`` (up to 256 at a time), writes each batch
    in one transaction on ``conn``, retries while another connection holds the lock (up to
    ``retry_seconds``), then falls back to one row at a time; counts into ``counts``."""

    def __init__(self, conn: sqlite3.Connection, items: queue.Queue, counts: StoreCounts, attempt: str,
                 retry_seconds: float, on_error: Callable[[str, BaseException], None]) -> None:
        self.conn = conn
        self.items = items
        self.counts = counts
        self.attempt = attempt
        self.retry_seconds = retry_seconds
        self.on_error = on_error

    def run(self) -> None:
        while True:
            item = self.items.get()
            batch = [item]
            while len(batch) < 256:
                try:
                    batch.append(self.items.get_nowait())
                except queue.Empty:
                    break
            stop = any(x is _STOP for x in batch)
            self._write([x for x in batch if x is not _STOP])
            for _ in batch:
                self.items.task_done()
            if stop:
                return

    def _write(self, batch: list[tuple]) -> None:
        """Write ``batch`` in one transaction; when it fails, retry while another connection holds
        the lock (bounded), then fall back to one row at a time so that only the rows the
        database refuses are lost (counted, and noted in ``events``)."""
        if not batch:
            return
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.05
        while True:
            try:
                self._transaction(batch)
                return
            except Exception as exc:  # noqa: BLE001 - disk full, read-only, locked, unbindable
                self._rollback()
                if _locked(exc) and time.monotonic() < deadline:
                    self.counts.retries += 1
                    if self.counts.retries == 1:
                        self.on_error("locked", exc)        # once: the retries are counted in .retries
                    time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                    delay = min(delay * 2, 1.0)
                    continue
                if len(batch) == 1 and not _is_many(batch[0]):
                    self._drop(batch[0], exc)
                    return
                break
        for item in batch:                  # one row at a time: a bad row costs itself only
            for row in ([(item[0], row, "row") for row in item[1]] if _is_many(item) else [item]):
                self._write([row])

    def _transaction(self, batch: list[tuple]) -> None:
        conn = self.conn
        conn.execute("BEGIN")
        steps = conflicts = 0
        first_conflict = None
        for sql, params, *mode in batch:
            kind = mode[0] if mode else None
            if kind == "many":
                conn.executemany(sql, params)
            elif kind == "step":
                moved = conn.execute("INSERT INTO step_history SELECT run, step, time, data, attempt, ? FROM steps "
                                     "WHERE run = ? AND step = ?", (time.time(), params[0], params[1])).rowcount
                if moved > 0:
                    conflicts += 1
                    first_conflict = first_conflict or params
                conn.execute("INSERT OR REPLACE INTO steps (run, step, time, data, attempt) VALUES (?, ?, ?, ?, ?)",
                             params)
                steps += 1
            elif kind == "step_replace":
                conn.execute("INSERT OR REPLACE INTO steps (run, step, time, data, attempt) VALUES (?, ?, ?, ?, ?)",
                             params)
            elif kind == "sync":
                continue
            else:
                conn.execute(sql, params)
        if conflicts and self.counts.step_conflicts == 0:
            conn.execute("INSERT INTO events (run, time, kind, detail) VALUES (?, ?, ?, ?)",
                         (first_conflict[0], time.time(), "step_conflict",
                          f"step {first_conflict[1]} was observed again (attempt {self.attempt}); the earlier "
                          "row is kept in step_history, later re-observed steps are counted"))
        conn.execute("COMMIT")
        self.counts.written_steps += steps
        self.counts.step_conflicts += conflicts
        if any(mode and mode[0] == "sync" for _, _, *mode in batch):
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")      # syncs the WAL before copying

    def _rollback(self) -> None:
        try:
            self.conn.execute("ROLLBACK")
        except Exception:  # noqa: BLE001 - no transaction open
            pass

    def _drop(self, item: tuple, exc: BaseException) -> None:
        """Count one row the database refused and note it in ``events`` (when that can be written)."""
        if item[0] == "PRAGMA wal_checkpoint(PASSIVE)":
            self.on_error("sync", exc)
            return
        self.counts.dropped += sum(1 for _ in _step_rows(item))
        self.counts.dropped_rows += 1
        self.on_error("write", exc)
        step = item[1][1] if item[0] == "step" else None
        what = f"step {step}" if step is not None else "a row (" + item[0].split("(")[0].strip()[:40] + ")"
        try:
            self.conn.execute("INSERT INTO events (run, time, kind, detail) VALUES (?, ?, ?, ?)",
                               (item[1][0] if item[1] and isinstance(item[1][0], str) else None, time.time(),
                                "store_row_dropped",
                                f"{what} could not be written: {type(exc).__name__}: {bindable(str(exc))[:200]}"))
        except Exception:  # noqa: BLE001 - the database refuses everything (disk full): counted above
            pass


def _is_many(item: tuple) -> bool:
    return len(item) > 2 and item[2] == "many"


def _step_rows(item: tuple) -> Iterable[None]:
    if item is not _STOP and len(item) > 2 and item[2] in ("step", "step_replace"):
        yield None
