"""Load a finished (or running) run into one shape, whatever recorded it.

Sources: an rlwatch run store; a TRL output directory (``checkpoint-N/trainer_state.json`` log
history, plus a run store when one is there); a verl checkpoint directory with the file logger's
JSONL; a live Prometheus (:mod:`.prometheus`). Each becomes a :class:`RunData`: per-step
values keyed like the signals (``{name: {labels: value}}``), alert events, checkpoints.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..core.values import Values
from .attempts import Lineage, lineage
from .verdicts import apply_hack_counts, read_hack_counts
from .downsample import MAX_POINTS, Buckets, bucket_width, downsample_scalars, row_stride
from .gaps import MissingSteps, missing_steps

# Framework scalars that measure the policy's real quality, best first.
QUALITY_KEYS = ("heldout_true_reward", "eval/true_reward", "eval_reward", "eval/reward", "val/test_score",
                "val-core/reward", "heldout_reward")


@dataclass
class RunData:
    run: str
    source: str
    steps: list[tuple[int, Values]] = field(default_factory=list)
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[tuple[int, str]] = field(default_factory=list)
    hack_examples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    #: Rows of attempts that a later attempt replaced by resuming at or before their step (store only):
    #: each with ``attempt``, ``superseded_by`` and ``resumed_at`` (the step the later attempt resumed at).
    superseded_alerts: list[dict[str, Any]] = field(default_factory=list)
    superseded_checkpoints: list[dict[str, Any]] = field(default_factory=list)
    #: Groups of processes that wrote the run at the same time (store only; not attempts of each other),
    #: each a list of ``{id, pid, host, first_step, last_step, started, last_time}``, oldest first.
    concurrent_writers: list[list[dict[str, Any]]] = field(default_factory=list)
    #: Steps the run observed that the store does not hold (store only; see :mod:`.gaps`).
    missing_steps: MissingSteps | None = None

    def series(self, name: str, labels: tuple[str, ...] = ()) -> list[tuple[int, float]]:
        out = [(s, v) for s, values in self.steps if (v := values.get(name, {}).get(labels)) is not None]
        if not out and not labels and name in self.scalars:
            out = list(self.scalars[name])
        return out

    def label_sets(self, name: str) -> set[tuple[str, ...]]:
        return {labels for _, values in self.steps for labels in values.get(name, {})}


# --- rlwatch run store ------------------------------------------------------------------------------

class PostmortemInputError(ValueError):
    """An input the post-mortem cannot read: said in one line, never a traceback."""


SQLITE_MAGIC = b"SQLite format 3\x00"
STORE_TABLES = ("runs", "steps", "scalars", "alerts", "checkpoints", "events", "hack_examples", "hack_counts")
#: A read that takes longer than this is stopped (a crafted store could make a query run forever).
READ_DEADLINE_S = 60.0
PROGRESS_EVERY = 10_000    # SQLite VM instructions between deadline checks


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")
_READ_ERRORS = (sqlite3.DatabaseError, ValueError, TypeError, KeyError, AttributeError, IndexError,
                UnicodeDecodeError, OverflowError, RecursionError)


def _number(value: Any) -> float | None:
    """A finite float, or None for anything else (strings, booleans, NaN, nested values)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _values(raw: Any) -> Values:
    """Validate one decoded step: {name: {labels: finite float}}; anything malformed is left out."""
    out: Values = {}
    if not isinstance(raw, dict):
        raise TypeError(f"a step is a JSON object, not {type(raw).__name__}")
    for name, rows in raw.items():
        if not isinstance(name, str) or not isinstance(rows, list):
            continue
        family = {}
        for row in rows:
            if isinstance(row, list) and row and all(isinstance(label, str) for label in row[:-1]):
                value = _number(row[-1])
                if value is not None:
                    family[tuple(row[:-1])] = value
        if family:
            out[name] = family
    return out


def check_store_file(path: Path) -> None:
    """Refuse what is not an SQLite file with a one-line reason."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except IsADirectoryError:
        raise PostmortemInputError(f"{path}: a directory, not a run store") from None
    except OSError as exc:
        raise PostmortemInputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if head != SQLITE_MAGIC:
        raise PostmortemInputError(f"{path}: not an rlwatch run store (not an SQLite database)")


def from_store(path: str | Path, run: str | None = None, signals: tuple[str, ...] | None = None,
               deadline: Any = None) -> RunData:
    """Read one run of a store; a damaged or crafted store ends in :class:`PostmortemInputError`,
    a malformed row costs that row (counted in the run's events), never the report. The rows are
    read as a stream; a run longer than :data:`~rlwatch.postmortem.downsample.MAX_POINTS` steps keeps
    ``signals`` only (all when None), in buckets (:mod:`.downsample`). ``deadline`` (an object with
    ``left()``, seconds) stops the read with one line when it passes."""
    import time

    from ..runs.store import StoreReader

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"not found: {path}")
    check_store_file(path)
    try:
        store = StoreReader(str(path))
    except sqlite3.DatabaseError as exc:
        raise PostmortemInputError(f"{path}: not a readable rlwatch run store ({exc})") from None
    read_by = time.monotonic() + READ_DEADLINE_S
    conn = store._conn
    conn.text_factory = _text          # invalid UTF-8 in a text column: kept (escaped on output), not fatal
    late = (lambda: time.monotonic() > read_by) if deadline is None else \
        (lambda: time.monotonic() > read_by or deadline.left() <= 0)
    conn.set_progress_handler(lambda: 1 if late() else 0, PROGRESS_EVERY)
    try:
        kinds = {r[0]: r[1] for r in conn.execute("SELECT name, type FROM sqlite_master")}
        if kinds.get("steps") != "table":
            raise PostmortemInputError(f"{path}: not an rlwatch run store (no steps table)" if "steps" not in kinds
                                       else f"{path}: not an rlwatch run store (steps is a {kinds['steps']}, "
                                            "not a table)")
        foreign = [t for t in STORE_TABLES if t in kinds and kinds[t] != "table"]
        if foreign:
            raise PostmortemInputError(f"{path}: not an rlwatch run store ({', '.join(foreign)} not tables)")
        return _read_store(store, path, run, kinds, signals)
    except sqlite3.OperationalError as exc:
        if "interrupt" in str(exc) and deadline is not None and deadline.left() <= 0:
            raise PostmortemInputError(f"{path}: no complete read within the {deadline.seconds:g} s deadline; "
                                       "stopped (raise --deadline)") from None
        if "interrupt" in str(exc):
            raise PostmortemInputError(f"{path}: reading the store took over {READ_DEADLINE_S:.0f} s; "
                                       "stopped (a damaged or crafted store)") from None
        raise PostmortemInputError(f"{path}: not a readable rlwatch run store ({exc})") from None
    except sqlite3.DatabaseError as exc:
        raise PostmortemInputError(f"{path}: not a readable rlwatch run store ({exc})") from None
    finally:
        store.close()


def _read_store(store: Any, path: Path, run: str | None, kinds: dict[str, str],
                signals: tuple[str, ...] | None = None) -> RunData:
    """Read ``run`` (default: the store's last) from the tables ``kinds`` names; a malformed row is
    skipped and counted in an ``unreadable`` event per kind of row."""
    runs = [str(r) for r in store.runs() if r is not None]
    if not runs:
        raise PostmortemInputError(f"{path}: the store holds no run")
    if run is None:
        run = runs[-1]
    elif run not in runs:
        raise PostmortemInputError(f"{path}: no run {run!r} (runs: {', '.join(runs)})")
    data = RunData(run=run, source=f"store {path}")
    skipped: dict[str, int] = {}

    def note(what: str, count: int = 1) -> None:
        skipped[what] = skipped.get(what, 0) + count

    try:
        lines = lineage(store, run)
    except _READ_ERRORS:
        note("malformed attempts table (every row read as the final attempt's)")
        lines = Lineage([])
    data.concurrent_writers = [[dict(id=a.id, pid=a.pid, host=a.host, first_step=a.first_step, last_step=a.last_step,
                                     started=a.started, last_time=a.last_time) for a in group]
                               for group in lines.concurrent]
    first, last, count = store._rows("SELECT MIN(step), MAX(step), COUNT(*) FROM steps WHERE run = ?", (run,))[0]
    width = bucket_width(first, last) if isinstance(first, int) and isinstance(last, int) and count > MAX_POINTS \
        else 1
    stride = row_stride(count) if width > 1 else 1
    data.steps, superseded = _read_steps(store, run, note, lines, width, signals if width > 1 else None, stride)
    if width > 1:
        data.events.append({"time": None, "kind": "downsampled", "detail": (
            f"{count} steps analysed in buckets of {width} steps (at most {MAX_POINTS} points per series: means, "
            "maxima for *_max signals" + (f", over every {stride}th step" if stride > 1 else "")
            + "); changes are dated to their bucket's first step")})
    data.missing_steps = missing_steps(store._conn, run, set(kinds))
    if superseded:
        data.events.append({"time": None, "kind": "superseded", "detail": (
            f"{superseded} steps of attempts that a later attempt resumed before are left out of the timeline")})
    if "scalars" in kinds:
        data.scalars = _read_scalars(store, run, note, width)
    if "alerts" in kinds:
        for alert in _read_alerts(store, run, note, lines):
            (data.superseded_alerts if "superseded_by" in alert else data.alerts).append(alert)
    if "checkpoints" in kinds:
        _read_checkpoints(store, run, note, lines, data)
    if "events" in kinds:
        for row in store._rows("SELECT time, kind, detail FROM events WHERE run = ? ORDER BY id", (run,)):
            data.events.append(dict(time=_number(row["time"]), kind=str(row["kind"]), detail=str(row["detail"])))
    if "hack_examples" in kinds:
        data.hack_examples = _read_hack_examples(store, run, note)
    if "hack_counts" in kinds and width == 1:      # the verdicts under the steps their episodes came from
        apply_hack_counts(data.steps, read_hack_counts(store, run, note))
    try:
        data.meta = store.meta(run)
    except _READ_ERRORS:
        note("malformed run metadata")
    for what, count in skipped.items():
        data.events.append({"time": None, "kind": "unreadable", "detail": f"{count} {what} skipped"})
    return data


def _superseded(row: Any, lines: Lineage, step: int | None) -> dict[str, Any]:
    """``{"attempt": id}`` of a row, plus ``superseded_by`` and ``resumed_at`` when a later attempt
    replaced it; empty when the row names no attempt and none can be inferred."""
    keys = row.keys()
    attempt = lines.attempt_at(row["attempt"] if "attempt" in keys else None,
                               _number(row["time"]) if "time" in keys else None)
    if attempt is None:
        return {}
    later = lines.superseded_by(str(attempt), step)
    return {"attempt": str(attempt)} | ({"superseded_by": later.id, "resumed_at": later.first_step} if later else {})


def _read_steps(store: Any, run: str, note: Callable[[str], None], lines: Lineage, width: int = 1,
                signals: tuple[str, ...] | None = None, stride: int = 1) -> tuple[list[tuple[int, Values]], int]:
    """(step, values) of every readable step row of the final timeline (of every ``stride``-th step),
    in step order, read as a stream and folded into buckets of ``width`` steps; only ``signals`` are
    decoded where given (by SQLite's JSON functions). Also the number of rows left out because a later
    attempt resumed before their step."""
    if signals:
        paths = ", ".join("'$." + name + "'" for name in signals if re.fullmatch(r"[a-z0-9_]+", name))
        column = (f"CASE WHEN json_valid(data) AND substr(ltrim(data), 1, 1) = '{{' "
                  f"THEN json_array(json_extract(data, {paths})) END")
    else:
        column = "data"
    buckets = Buckets(width)
    superseded = 0
    resumed = len(lines.attempts) > 1
    rows = store._conn.execute(f"SELECT step, time, attempt, {column} FROM steps WHERE run = ?"
                               + (f" AND step % {int(stride)} = 0" if stride > 1 else "") + " ORDER BY step", (run,))
    for row in rows:
        try:
            step = int(row[0])
            if resumed and "superseded_by" in _superseded(row, lines, step):
                superseded += 1
                continue
            buckets.add(step, _values(json.loads(row[3])) if not signals else _picked(signals, row[3]))
        except _READ_ERRORS:
            note("malformed step rows")
    return buckets.finish(), superseded


def _picked(signals: tuple[str, ...], text: str | None) -> Values:
    """The values of ``signals`` from ``[[rows of signal 1], ...]`` (a JSON array in their order)."""
    if text is None:
        raise ValueError("not a JSON object")
    picked = json.loads(text)[0]
    if len(signals) == 1:
        picked = [picked]
    return _values({name: rows for name, rows in zip(signals, picked) if rows is not None})


def _read_scalars(store: Any, run: str, note: Callable[[str], None], width: int = 1
                  ) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value)]}`` of the framework scalars with a finite value, read as a stream and
    folded into bucket means of ``width`` steps as it goes."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    pending: dict[str, list[tuple[int, float]]] = {}         # the rows of each name's open bucket
    for row in store._conn.execute("SELECT step, name, value FROM scalars WHERE run = ? ORDER BY step", (run,)):
        value = _number(row[2])
        try:
            step, name = int(row[0]), str(row[1])
        except _READ_ERRORS:
            note("malformed scalar rows")
            continue
        points = scalars.setdefault(name, [])
        if value is None:
            continue
        if width == 1:
            points.append((step, value))
            continue
        rows = pending.setdefault(name, [])
        if rows and step - step % width != rows[0][0] - rows[0][0] % width:
            points += downsample_scalars(rows, width)
            rows.clear()
        rows.append((step, value))
    for name, rows in pending.items():
        scalars[name] += downsample_scalars(rows, width)
    return {k: pts for k, pts in scalars.items() if pts}


def _read_alerts(store: Any, run: str, note: Callable[[str], None], lines: Lineage) -> list[dict[str, Any]]:
    """The alert events in the order they were written (labels as strings), each with its attempt."""
    alerts = []
    for row in store._rows("SELECT * FROM alerts WHERE run = ? ORDER BY id", (run,)):
        try:
            labels = json.loads(row["labels"] or "{}")
            if not isinstance(labels, dict):
                raise TypeError("labels")
            step = None if row["step"] is None else int(row["step"])
            alerts.append(dict(step=step, time=_number(row["time"]),
                               name=str(row["name"]), severity=str(row["severity"] or ""),
                               state=str(row["state"] or "firing"), value=_number(row["value"]),
                               labels={str(k): str(v) for k, v in labels.items()}, **_superseded(row, lines, step)))
        except _READ_ERRORS:
            note("malformed alert rows")
    return alerts


def _read_checkpoints(store: Any, run: str, note: Callable[[str], None], lines: Lineage, data: RunData) -> None:
    """The run's checkpoints into ``data.checkpoints``; those saved by a superseded attempt after the
    step a later attempt resumed at (a dead branch's weights) into ``data.superseded_checkpoints``."""
    for row in store._rows("SELECT * FROM checkpoints WHERE run = ? ORDER BY step", (run,)):
        try:
            step, path = int(row["step"]), str(row["path"])
            attempt = _superseded(row, lines, step)
        except _READ_ERRORS:
            note("malformed checkpoint rows")
            continue
        if "superseded_by" in attempt:
            data.superseded_checkpoints.append(dict(step=step, path=path, **attempt))
        else:
            data.checkpoints.append((step, path))


def _read_hack_examples(store: Any, run: str, note: Callable[[str], None]) -> list[dict[str, Any]]:
    examples = []
    for row in store._rows("SELECT * FROM hack_examples WHERE run = ? ORDER BY id", (run,)):
        try:
            examples.append(dict(step=int(row["step"]), env=str(row["env"]), detector=str(row["detector"]),
                                 reason=str(row["reason"]), prompt=str(row["prompt"]), response=str(row["response"]),
                                 reward=_number(row["reward"])))
        except _READ_ERRORS:
            note("malformed hack example rows")
    return examples


# --- TRL output directory -----------------------------------------------------------------------------

TRL_KEYS = {   # TRL log key -> rlwatch signal (where the meaning coincides)
    "reward": "reward_mean", "reward_std": "reward_std", "entropy": "entropy_mean",
    "completions/clipped_ratio": "truncated_ratio", "completions/mean_length": "response_length_mean",
    "completions/max_length": "response_length_max",
}


def from_trl(directory: str | Path, signals: tuple[str, ...] | None = None) -> RunData:
    directory = Path(directory)
    checkpoints = sorted(((int(m.group(1)), p) for p in directory.glob("checkpoint-*")
                          if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name))))
    stores = sorted(directory.glob("*.db")) + sorted(directory.glob("rlwatch*/*.db"))
    data = from_store(stores[0], signals=signals) if stores else RunData(run=directory.name, source=f"TRL {directory}")
    data.source = f"TRL {directory}" + (f" + store {stores[0]}" if stores else "")
    history: list[dict] = []
    if checkpoints:
        state = checkpoints[-1][1] / "trainer_state.json"
        if state.exists():
            try:
                history = json.loads(state.read_text()).get("log_history", [])
            except (ValueError, AttributeError, OSError) as exc:
                raise PostmortemInputError(f"{state}: not a readable trainer state ({exc})") from None
            if not isinstance(history, list):
                raise PostmortemInputError(f"{state}: log_history is not a list")
    by_step: dict[int, Values] = {s: v for s, v in data.steps}
    for entry in history:
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in entry.items():
            value = _number(value)
            if value is None or key == "step":
                continue
            data.scalars.setdefault(str(key), []).append((step, value))
            if key in TRL_KEYS and not data.steps:
                by_step.setdefault(step, {})[TRL_KEYS[key]] = {(): value}
    if not data.steps:
        data.steps = sorted(by_step.items())
    known = {p for _, p in data.checkpoints}
    data.checkpoints += [(s, str(p)) for s, p in checkpoints if str(p) not in known]
    data.checkpoints.sort()
    return data


# --- verl checkpoint directory + file logger JSONL ----------------------------------------------------

VERL_KEYS = {
    "rollout_corr/kl": "mismatch_kl_k1", "rollout_corr/k3_kl": "mismatch_kl_k3",
    "rollout_corr/chi2_token": "mismatch_chi2_token", "rollout_corr/chi2_seq": "mismatch_chi2_sequence",
    "rollout_corr/rollout_is_eff_sample_size": "is_ess_ratio",
    "rollout_corr/rollout_is_ratio_fraction_high": "is_tis_high_ratio",
    "rollout_corr/rollout_is_ratio_fraction_low": "is_tis_low_ratio",
    "critic/score/mean": "reward_mean", "actor/entropy": "entropy_mean",
    "response_length/mean": "response_length_mean", "response_length/max": "response_length_max",
    "training/off_policy/trajectory_staleness/mean": "version_lag_mean",
    "training/off_policy/trajectory_staleness/max": "version_lag_max",
}


def from_verl(directory: str | Path, signals: tuple[str, ...] | None = None) -> RunData:
    directory = Path(directory)
    logs = sorted(directory.rglob("*.jsonl"))
    stores = sorted(directory.rglob("*.db"))
    data = from_store(stores[0], signals=signals) if stores else RunData(run=directory.name, source=f"verl {directory}")
    data.source = f"verl {directory}" + (f" + store {stores[0]}" if stores else "")
    by_step: dict[int, Values] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("step"), int) \
                    or isinstance(entry.get("step"), bool):
                continue
            step, payload = int(entry["step"]), entry.get("data", entry)
            if not isinstance(payload, dict):
                continue
            for key, value in payload.items():
                value = _number(value)
                if value is not None:
                    data.scalars.setdefault(str(key), []).append((step, value))
                    if key in VERL_KEYS:
                        by_step.setdefault(step, {})[VERL_KEYS[key]] = {(): value}
    if not data.steps:
        data.steps = sorted(by_step.items())
    for path in directory.glob("global_step_*"):
        m = re.fullmatch(r"global_step_(\d+)", path.name)
        if m and path.is_dir():
            data.checkpoints.append((int(m.group(1)), str(path)))
    data.checkpoints = sorted(set(data.checkpoints))
    return data


def load_path(path: str | None, run: str | None = None, signals: tuple[str, ...] | None = None,
              deadline: Any = None) -> RunData:
    """Detect the kind of ``path`` (a run store, a TRL output directory, a verl checkpoint directory,
    a directory of stores) and load it; ``run`` picks the run in a store; ``signals`` and ``deadline``
    as :func:`from_store` takes them."""
    if path is None:
        raise PostmortemInputError("give a run store, a TRL output directory, a verl checkpoint directory, "
                                   "or --prometheus")
    p = Path(path)
    if p.is_file():
        return from_store(p, run, signals, deadline)
    if not p.is_dir():
        raise FileNotFoundError(f"not found: {path}")
    if any(p.glob("checkpoint-*/trainer_state.json")):
        return from_trl(p, signals)
    if any(p.glob("global_step_*")) or any(p.rglob("*.jsonl")):
        return from_verl(p, signals)
    stores = sorted(p.glob("*.db"))
    if stores:
        return from_store(stores[0], run, signals, deadline)
    raise PostmortemInputError(f"{path}: not a run store, TRL output directory or verl checkpoint directory")
