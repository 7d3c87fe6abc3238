"""Which attempt of a resumed run each stored row belongs to, and which rows a later attempt superseded.

An attempt is one process that wrote the run (``attempts`` in the store). A later attempt that
resumed at step ``f`` (its first observed step) replaces, from ``f`` on, everything earlier attempts
recorded: their steps, alerts and checkpoints from ``f`` on belong to a dead branch of the run. The
final timeline is what no later attempt replaced. Rows without an attempt (stores written before
alerts and checkpoints carried one) are given the latest attempt started at or before their time.

Processes that wrote the run at the same time (one started before another wrote its last step: two
trainers given one run name and one store directory) are not attempts of each other: none replaces
the other's rows, and :attr:`Lineage.concurrent` names them, so the post-mortem says so and shows
every one's alerts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Attempt:
    id: str
    started: float | None
    first_step: int | None          # None: the attempt observed no step
    last_step: int | None
    last_time: float | None = None  # when it observed its last step (Unix seconds)
    pid: int | None = None
    host: str | None = None

    def overlaps(self, later: "Attempt") -> bool:
        """Whether ``later`` (started after this one) started before this one wrote its last step."""
        return None not in (later.started, self.last_time) and later.started < self.last_time


class Lineage:
    """The attempts of one run, oldest first, and which of them owns each step of the final timeline."""

    def __init__(self, attempts: list[Attempt]) -> None:
        self.attempts = attempts
        self._order = {a.id: i for i, a in enumerate(attempts)}
        starts = [(a.started, a.id) for a in attempts if a.started is not None]
        self._starts, self._start_ids = [t for t, _ in starts], [i for _, i in starts]
        self._together = {(a.id, b.id) for i, a in enumerate(attempts) for b in attempts[i + 1:] if a.overlaps(b)}
        #: Groups of attempts that wrote the run at the same time (each group oldest first).
        self.concurrent: list[list[Attempt]] = _groups(attempts, self._together)

    def attempt_at(self, attempt: str | None, time: float | None) -> str | None:
        """``attempt``, or for a row that names none, the latest attempt started at or before ``time``."""
        if attempt is not None or time is None:
            return attempt
        i = bisect.bisect_right(self._starts, time)
        return self._start_ids[i - 1] if i else None

    def superseded_by(self, attempt: str | None, step: int | None) -> Attempt | None:
        """The later attempt that replaced ``attempt``'s row at ``step`` (resumed at or before it), or None."""
        if attempt not in self._order or step is None:
            return None
        later = [a for a in self.attempts[self._order[attempt] + 1:]
                 if a.first_step is not None and a.first_step <= step and (attempt, a.id) not in self._together]
        return min(later, key=lambda a: a.first_step) if later else None


def lineage(store: Any, run: str) -> Lineage:
    """The attempts of ``run`` in ``store`` (a :class:`~rlwatch.runs.store_reader.StoreReader`), ordered by
    start time, with the range of steps each observed (kept in ``steps`` or ``step_history``)."""
    started = {a["id"]: a["started"] for a in store.attempts(run)}
    if len(started) == 1 and has_column(store, "steps", "attempt"):
        # one process wrote the run: nothing to tell apart, and no scan of a long run's rows (their
        # attempt column lies past the data)
        ((only, at),) = started.items()
        return Lineage([Attempt(str(only), _float(at), None, None)])
    processes = {a["id"]: a for a in store.attempts(run)}
    sources = [f"SELECT attempt, step, time FROM {table} WHERE run = ?" for table in ("steps", "step_history")
               if has_column(store, table, "attempt")]
    ranges = {r["attempt"]: r for r in store._rows(
        "SELECT attempt, MIN(step) AS first, MAX(step) AS last, MIN(time) AS t, MAX(time) AS end "
        f"FROM ({' UNION ALL '.join(sources)}) WHERE attempt IS NOT NULL GROUP BY attempt",
        (run,) * len(sources))} if sources else {}
    attempts = []
    for attempt in set(started) | set(ranges):
        row, process = ranges.get(attempt), processes.get(attempt, {})
        attempts.append(Attempt(str(attempt), _float(started.get(attempt, row["t"] if row else None)),
                                _int(row["first"]) if row else None, _int(row["last"]) if row else None,
                                _float(row["end"]) if row else None, _int(process.get("pid")),
                                str(process["host"]) if process.get("host") is not None else None))
    attempts.sort(key=lambda a: (a.started is None, a.started or 0.0, a.id))
    return Lineage(attempts)


def _groups(attempts: list[Attempt], together: set[tuple[str, str]]) -> list[list[Attempt]]:
    """The attempts linked by ``together`` (pairs of ids), as groups of two or more, oldest first."""
    groups = [{a.id} for a in attempts]
    for x, y in together:
        gx, gy = (next(g for g in groups if i in g) for i in (x, y))
        if gx is not gy:
            gx |= gy
            groups.remove(gy)
    return [[a for a in attempts if a.id in g] for g in groups if len(g) > 1]


def has_column(store: Any, table: str, column: str) -> bool:
    """Whether ``table`` exists in ``store`` with ``column`` (stores from older versions lack some)."""
    return any(r[1] == column for r in store._rows(f"PRAGMA table_info({table})"))


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
