"""Read access to a run store (:mod:`rlwatch.runs.store` writes it): safe while a run is writing it
(the file is opened read-only; SQLite's WAL lets readers in during writes). ``rlwatch.runs.store``
re-exports :class:`StoreReader`, :class:`StepRow` and :func:`decode_values`."""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from typing import Any, Iterable


def decode_values(text: str) -> dict[str, dict[tuple[str, ...], float | None]]:
    """A step's ``data`` column back into ``{name: {labels: value}}`` (the inverse of
    :func:`rlwatch.runs.store.encode_values`; NaN/inf were stored as null and read as None)."""
    raw = json.loads(text)
    return {name: {tuple(row[:-1]): row[-1] for row in rows} for name, rows in raw.items()}


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
        """One row per step: its latest observation."""
        return [StepRow(r["step"], r["time"], decode_values(r["data"]))
                for r in self._rows("SELECT step, time, data FROM steps WHERE run = ? ORDER BY step", (run,))]

    def step_history(self, run: str) -> list[tuple[StepRow, str | None, float]]:
        """Earlier observations of re-observed steps: (row, attempt that wrote it, time replaced)."""
        if not self._has_table("step_history"):
            return []
        return [(StepRow(r["step"], r["time"], decode_values(r["data"])), r["attempt"], r["replaced"])
                for r in self._rows("SELECT * FROM step_history WHERE run = ? ORDER BY replaced, step", (run,))]

    def attempts(self, run: str) -> list[dict[str, Any]]:
        """The processes that wrote ``run``, oldest first (id, started, pid, host)."""
        if not self._has_table("attempts"):
            return []
        return [dict(id=r["id"], started=r["started"], pid=r["pid"], host=r["host"])
                for r in self._rows("SELECT * FROM attempts WHERE run = ? ORDER BY started", (run,))]

    def _has_table(self, name: str) -> bool:
        return bool(self._rows("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)))

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
        """Alert events in the order written; ``attempt``: the process that raised it (None in older stores)."""
        return [dict(step=r["step"], time=r["time"], name=r["name"], severity=r["severity"], state=r["state"],
                     labels=json.loads(r["labels"] or "{}"), value=r["value"],
                     annotations=json.loads(r["annotations"] or "{}"),
                     attempt=r["attempt"] if "attempt" in r.keys() else None)
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
