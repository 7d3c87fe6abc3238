"""The corpus: ``manifest.json`` read into :class:`CorpusRun` entries, and a run's files read into a
:class:`rlwatch.replay.LoggedRun` under the frameworks' own key names.

Some sources export their logs with short column names of their own (a W&B pull written by the
authors' script, for instance); the manifest's ``key_maps`` names the framework key each such column
holds, as the source's own script documents it. The harness renames the columns on load; the values
are the file's, unchanged.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlwatch.replay import LoggedRun, ReplayInputError, load, load_all
from rlwatch.replay.formats import Rows, _add
from rlwatch.replay.logged import from_rows

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.json"
SPLITS = ("tuning", "test")
OUTCOMES = ("collapsed", "healthy", "unresolved")


@dataclass(frozen=True)
class CorpusRun:
    """One logged run of the corpus: its files (relative to this package), format, column renames,
    reward key, source, the authors' collapse step (None: they name none) and split."""

    id: str
    files: tuple[str, ...]
    format: str
    split: str
    source: str
    outcome: str
    collapse_step: int | None
    reward_key: str | None = None
    key_map: dict[str, str] = field(default_factory=dict)
    citation: dict[str, Any] = field(default_factory=dict)
    step_column: str | None = None
    #: SwanLab chart exports hold one metric for several runs, one column ``<run>-<key>_step`` each: the run's name
    column_prefix: str | None = None

    def paths(self) -> list[Path]:
        """The run's data files on disk."""
        return [HERE / f for f in self.files]


def read_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    """The manifest as a dict (``sources``, ``key_maps``, ``runs``)."""
    return json.loads(path.read_text(encoding="utf-8"))


def runs(split: str = "all", path: Path = MANIFEST) -> list[CorpusRun]:
    """The corpus runs of ``split`` (``tuning``, ``test`` or ``all``), in manifest order."""
    doc = read_manifest(path)
    maps = doc.get("key_maps", {})
    out = []
    for entry in doc["runs"]:
        if split != "all" and entry["split"] != split:
            continue
        key_map = entry.get("key_map") or {}
        if isinstance(key_map, str):
            key_map = maps[key_map]
        citation = {k: entry[k] for k in ("source_path", "source_commit", "source_url", "collapse_quote",
                                          "quote_where") if k in entry}
        out.append(CorpusRun(id=entry["id"], files=tuple(entry["files"]), format=entry["format"],
                             split=entry["split"], source=entry["source"], outcome=entry["outcome"],
                             collapse_step=entry.get("collapse_step"), reward_key=entry.get("reward_key"),
                             key_map=dict(key_map), citation=citation, step_column=entry.get("step_column"),
                             column_prefix=entry.get("column_prefix")))
    return out


def _renamed(run: LoggedRun, key_map: dict[str, str], reward_key: str | None) -> LoggedRun:
    """``run`` with its columns renamed by ``key_map`` (the non-finite values kept as logged)."""
    rows: dict[int, dict[str, float]] = {}
    for step, row in zip(run.steps, run.rows):
        rows[step] = {key_map.get(k, k): v for k, v in row.items()}
    for key, steps in run.nonfinite.items():
        for step in steps:
            rows.setdefault(step, {})[key_map.get(key, key)] = float("nan")
    return from_rows(rows, run.source, run.fmt, reward_key)


def _csv_by_column(path: Path, step_column: str) -> LoggedRun:
    """A CSV whose step is in a column of the source's own name (``update``, for instance), each other
    non-empty cell under its column's name; the values are the file's."""
    reader = csv.reader(io.StringIO(path.read_text(encoding="utf-8")))
    header = next(reader)
    at = header.index(step_column)
    rows: Rows = {}
    for record in reader:
        if len(record) > at:
            _add(rows, record[at], {h: v for i, (h, v) in enumerate(zip(header, record)) if i != at and v != ""})
    return from_rows(rows, str(path), "csv")


def load_run(entry: CorpusRun) -> LoggedRun:
    """The logged run of ``entry`` under the frameworks' key names (one file per run, but for SwanLab's
    exports: one file per metric, the run's columns picked by :attr:`CorpusRun.column_prefix`)."""
    if entry.format == "swanlab_csv":
        if not entry.column_prefix:
            raise ValueError(f"{entry.id}: a SwanLab export needs the run's column_prefix")
        [run] = load_all([str(p) for p in entry.paths()], fmt="swanlab", run=entry.column_prefix,
                         reward_key=entry.reward_key)
        if isinstance(run, ReplayInputError):
            raise run
        return replace(run, source=entry.id)
    if len(entry.files) != 1:
        raise ValueError(f"{entry.id}: one file per run expected, got {len(entry.files)}")
    if entry.step_column:
        return _renamed(_csv_by_column(entry.paths()[0], entry.step_column), entry.key_map, entry.reward_key)
    fmt = "csv" if entry.format == "wandb_csv" else None if entry.format == "auto" else entry.format
    if not entry.key_map:
        return load(entry.paths()[0], reward_key=entry.reward_key, fmt=fmt)
    raw = load(entry.paths()[0], fmt=fmt)
    return _renamed(raw, entry.key_map, entry.reward_key)
