"""Steps a run observed that its store does not hold (a full disk, a full queue, a killed writer).

The steps a run observed are inferred from the store itself: the run's step spacing is the most
common difference between consecutive stored steps (1 for a run observed every step, k for one
observed every k steps), a larger difference is a hole, and steps that later rows name (alerts,
checkpoints, hack examples, framework scalars, a ``store_row_dropped`` note) beyond the last stored
step are a hole at the end. Read with SQL over the step numbers only, so a 10^6-step store costs
one pass over an index.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass, field
from typing import Any

#: The most ranges kept (the largest holes first); the count of missing steps covers every one.
MAX_RANGES = 50
#: Tables whose rows carry a step the run reached.
STEP_TABLES = ("scalars", "alerts", "checkpoints", "hack_examples")
_DROPPED_STEP = re.compile(r"^step (\d+) could not be written")


@dataclass
class MissingSteps:
    """Steps missing from a store: ``count`` of ``expected`` (the steps first..last at ``spacing``),
    ``ranges`` the holes (first, last missing step, inclusive; the largest MAX_RANGES, in step order),
    ``more_ranges`` the holes left out of ``ranges``."""

    count: int
    expected: int
    first: int
    last: int
    spacing: int
    ranges: list[tuple[int, int]] = field(default_factory=list)
    more_ranges: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count, "expected": self.expected, "first": self.first, "last": self.last,
                "spacing": self.spacing, "ranges": [list(r) for r in self.ranges], "more_ranges": self.more_ranges}

    def text(self) -> str:
        """One line: how many, of how many, and where."""
        where = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in self.ranges)
        more = f" and {self.more_ranges} more ranges" if self.more_ranges else ""
        every = f" (one every {self.spacing})" if self.spacing > 1 else ""
        return (f"missing steps: {self.count:,} of the {self.expected:,} steps {self.first}..{self.last}{every} are "
                f"not in the store: {where}{more} (lost by the writer: a full disk, a full queue or a killed "
                "process; rlwatch_store_dropped_steps_total counts them); nothing is known of those steps")


def _rows(conn: Any, sql: str, params: tuple) -> list[tuple]:
    return list(conn.execute(sql, params))


def _last_named(conn: Any, run: str, tables: set[str]) -> int | None:
    """The last step a row other than a step row names (None when none does)."""
    last = None
    for table in STEP_TABLES:
        if table in tables:
            (value,) = _rows(conn, f"SELECT MAX(step) FROM {table} WHERE run = ? AND typeof(step) = 'integer'",
                             (run,))[0]
            if isinstance(value, int) and (last is None or value > last):
                last = value
    if "events" in tables:
        for (detail,) in _rows(conn, "SELECT detail FROM events WHERE run = ? AND kind = 'store_row_dropped'",
                               (run,)):
            match = _DROPPED_STEP.match(str(detail))
            if match and (last is None or int(match.group(1)) > last):
                last = int(match.group(1))
    return last


def missing_steps(conn: Any, run: str, tables: set[str]) -> MissingSteps | None:
    """The steps of ``run`` missing from the store behind ``conn`` (an sqlite3 connection), None when
    none is (or fewer than two steps are stored, or a crafted store's step numbers cannot be read)."""
    try:
        return _missing_steps(conn, run, tables)
    except sqlite3.OperationalError as exc:
        if "interrupt" in str(exc):
            raise                             # the post-mortem's deadline: reported by its reader
        return None
    except (sqlite3.DatabaseError, TypeError, ValueError, OverflowError):
        return None


def _missing_steps(conn: Any, run: str, tables: set[str]) -> MissingSteps | None:
    gaps_sql = ("SELECT prev, step FROM (SELECT step, LAG(step) OVER (ORDER BY step) AS prev FROM steps "
                "WHERE run = ? AND typeof(step) = 'integer') WHERE prev IS NOT NULL")
    spacing_rows = _rows(conn, f"SELECT step - prev AS d, COUNT(*) AS n FROM ({gaps_sql}) WHERE step > prev "
                               "GROUP BY d ORDER BY n DESC, d LIMIT 1", (run,))
    if not spacing_rows:
        return None
    spacing = int(spacing_rows[0][0])
    first, last = _rows(conn, "SELECT MIN(step), MAX(step) FROM steps WHERE run = ? AND typeof(step) = 'integer'",
                        (run,))[0]
    holes = [(prev + spacing, step - spacing) for prev, step in
             _rows(conn, f"SELECT prev, step FROM ({gaps_sql}) WHERE step - prev > ? ORDER BY step",
                   (run, spacing))]
    named = _last_named(conn, run, tables)
    if named is not None and named >= last + spacing:
        holes.append((last + spacing, named - (named - last) % spacing))
        last = holes[-1][1]
    if not holes:
        return None
    count = sum((b - a) // spacing + 1 for a, b in holes)
    kept = sorted(sorted(holes, key=lambda h: h[0] - h[1])[:MAX_RANGES])
    return MissingSteps(count=count, expected=(last - first) // spacing + 1, first=first, last=last,
                        spacing=spacing, ranges=kept, more_ranges=len(holes) - len(kept))
