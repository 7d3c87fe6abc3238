"""The logged-metrics formats ``rlwatch replay`` reads, each parsed into ``(step, {key: value})`` rows
under the framework's own key names (docs/replay.md lists them with an example line of each).

- ``trl``: TRL's / transformers' ``trainer_state.json`` (``log_history``: one dict per logging step,
  ``step`` in it; the final summary entry, with ``train_runtime``, is left out).
- ``verl-console``: verl's console logger lines, ``step:N - key:value - ...``
  (``verl.utils.logger.aggregate_logger.LocalLogger``; values as ``pprint`` writes them, numpy
  scalars included), anywhere in a line (Ray's ``(TaskRunner pid=...)`` prefix, other lines skipped).
- ``verl-jsonl``: verl's ``file`` logger, one ``{"step": N, "data": {...}}`` per line; a flat
  ``{"step": N, key: value, ...}`` line (``_step`` too) reads the same.
- ``openrlhf``: OpenRLHF's console log, ``✨ Global step N: {'key': value, ...}`` (``ppo_trainer.py``).
- ``ms-swift``: ms-swift's ``logging.jsonl`` in the output directory, one JSON object per logged row, the step
  in ``global_step/max_steps`` (``"12/5715"``, ``swift/trainers/patcher.py``); an evaluation's row
  (``eval_*`` keys) is merged into its step's, the training's totals (``train_runtime``) and the closing
  summary (``log_history``, ``last_model_checkpoint``: no step field) are left out.
- ``csv``: a W&B or TensorBoard export with one column per key: the step column is the first of
  :data:`STEP_COLUMNS` present; W&B's ``<key>__MIN`` / ``<key>__MAX`` and ``_runtime``-like columns
  are ignored, a ``<run name> - `` prefix shared by every column is removed, and the ``train/`` prefix
  TRL's and OpenRLHF's W&B / TensorBoard loggers put on every training key is removed (``eval/`` kept).
  W&B chart exports (one panel's ``Download CSV``) of the same run, given together, are one run.
- ``tensorboard-csv``: TensorBoard's own per-tag export (``Wall time,Step,Value``), the key from the
  file name (``run-<run>-tag-<tag>.csv``); several such files are one run.
- ``swanlab``: SwanLab's chart export, one metric for several runs (``step``, then ``<run>-<key>_step`` per
  run); every column read under ``<run>-<key>``, one run's columns of several exports picked by
  :func:`swanlab_run` (the runs named by :func:`swanlab_runs`).
"""

from __future__ import annotations

import ast
import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

Rows = dict[int, dict[str, float]]

FORMATS = ("trl", "verl-console", "verl-jsonl", "openrlhf", "ms-swift", "csv", "tensorboard-csv", "swanlab")
STEP_COLUMNS = ("train/global_step", "global_step", "step", "Step", "_step", "trainer/global_step")
#: The key of TRL's final ``log_history`` entry (the run's totals, at the last step), not a step's metrics.
TRL_SUMMARY_KEY = "train_runtime"
MAX_BYTES = 512 << 20
#: ms-swift's log file in its output directory, and the step field of each of its rows (``"<step>/<max_steps>"``).
MSSWIFT_LOG = "logging.jsonl"
MSSWIFT_STEP = "global_step/max_steps"
#: A SwanLab chart export's step column, and the end of each of its ``<run>-<key>_step`` columns.
SWANLAB_STEP, SWANLAB_END = "step", "_step"

_VERL_STEP = re.compile(r"(?:^|\s|\))step:(\d+) - (.*)$", re.M)
_OPENRLHF = re.compile(r"Global step (\d+): (\{.*\})[ \t\r]*$", re.M)
_OPENRLHF_EVAL = re.compile(r"Evaluation completed in .*?, global_step (\d+), eval_metrics: (\{.*\})[ \t\r]*$", re.M)
_REPR_PAIR = re.compile(r"'([^']+)':\s*(?:(?:np|numpy)\.\w+\(|tensor\()?(-?(?:[0-9.]+(?:[eE][-+]?\d+)?|nan|inf))")
_NUMPY_SCALAR = re.compile(r"\b(?:np|numpy)\.(?:float|int|uint)\d*\(([^()]*)\)")
#: A 0-d torch tensor's repr, as ms-swift's ``check_json_format`` writes a tensor it logs: ``tensor(0.5000)``,
#: ``tensor(0.5000, device='cuda:0')``.
_TENSOR_SCALAR = re.compile(r"tensor\(\s*([^,()]+?)\s*(?:,[^()]*)?\)")
_TB_TAG = re.compile(r"^run[-_].*?[-_]tag[-_](.+)$")
_MSSWIFT_STEP_VALUE = re.compile(r"\s*(\d+)\s*/\s*\d+\s*")


class ReplayInputError(ValueError):
    """A file replay cannot read: said in one line, never a traceback."""


def number(value: Any) -> float | None:
    """``value`` as a float (booleans and non-numbers: None; NaN and infinities kept)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        match = _NUMPY_SCALAR.fullmatch(text) or _TENSOR_SCALAR.fullmatch(text)
        text = match.group(1) if match else text
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _add(rows: Rows, step: Any, mapping: dict[str, Any], skip: Iterable[str] = ()) -> None:
    """Merge ``mapping``'s numeric values into ``rows[step]`` (a later value of a key wins)."""
    s = number(step)
    if s is None or not math.isfinite(s) or s != int(s) or s < 0:
        return
    skipped = set(skip)
    values = {str(k): v for k, v in ((k, number(v)) for k, v in mapping.items()) if v is not None and k not in skipped}
    if values:
        rows.setdefault(int(s), {}).update(values)


def parse_trl(text: str, name: str) -> Rows:
    """``trainer_state.json``: ``log_history``'s entries by their ``step``."""
    try:
        state = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReplayInputError(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ReplayInputError(f"{name}: no log_history list (not a trainer_state.json)")
    rows: Rows = {}
    for entry in history:
        if isinstance(entry, dict) and TRL_SUMMARY_KEY not in entry:
            _add(rows, entry.get("step"), entry, skip=("step",))
    return rows


def parse_verl_console(text: str, name: str) -> Rows:
    """verl's ``step:N - key:value - ...`` lines; other lines are skipped."""
    rows: Rows = {}
    for line in text.splitlines():
        match = _VERL_STEP.search(line)
        if not match:
            continue
        pairs = {}
        for part in match.group(2).split(" - "):
            key, sep, value = part.partition(":")
            if sep:
                pairs[key.strip()] = value.strip()
        _add(rows, match.group(1), pairs)
    return rows


def _json_lines(text: str, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-empty line; a line that is not a JSON object raises
    :class:`ReplayInputError` naming it."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise ReplayInputError(f"{name}: line {lineno} is not JSON") from None
        if not isinstance(entry, dict):
            raise ReplayInputError(f"{name}: line {lineno} is not a JSON object")
        yield lineno, entry


def parse_jsonl(text: str, name: str) -> Rows:
    """verl's file logger (``{"step": N, "data": {...}}``) or flat JSON lines with a step key."""
    rows: Rows = {}
    for _, entry in _json_lines(text, name):
        if isinstance(entry.get("data"), dict):       # orjson writes NaN and infinities as null
            _add(rows, entry.get("step"), {k: math.nan if v is None else v for k, v in entry["data"].items()})
        else:
            step_key = next((k for k in STEP_COLUMNS if k in entry), None)
            if step_key is not None:
                _add(rows, entry[step_key], entry, skip=(step_key,))
    return rows


def parse_msswift(text: str, name: str) -> Rows:
    """ms-swift's ``logging.jsonl``: each row's step from ``global_step/max_steps`` (``"12/5715"``); its
    strings (``elapsed_time``, ``remaining_time``) are skipped; a line without that field (the summary
    ms-swift appends when training ends, crashed or not) and the training's totals are left out. A step
    logged again (a resumed run appending to the same file) keeps its last values, key by key."""
    rows: Rows = {}
    for lineno, entry in _json_lines(text, name):
        if MSSWIFT_STEP not in entry or TRL_SUMMARY_KEY in entry:
            continue
        value = entry[MSSWIFT_STEP]
        match = _MSSWIFT_STEP_VALUE.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise ReplayInputError(f"{name}: line {lineno}: {MSSWIFT_STEP} is {str(value)[:40]!r}, not STEP/MAX_STEPS")
        _add(rows, match.group(1), entry, skip=(MSSWIFT_STEP,))
    return rows


def _status(text: str) -> dict[str, Any]:
    """A logged status dict's repr as a dict: a Python literal (numpy scalars, nan, inf included),
    else its ``'key': number`` pairs (a value that is no literal, a tensor's repr, costs only itself)."""
    literal = _NUMPY_SCALAR.sub(r"\1", text)
    literal = re.sub(r"(?<![\w'\"])(-?)(nan|inf)(?![\w'\"])", r"'\1\2'", literal)
    try:
        status = ast.literal_eval(literal)
        if isinstance(status, dict):
            return status
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    return dict(_REPR_PAIR.findall(text))


def parse_openrlhf(text: str, name: str) -> Rows:
    """OpenRLHF's ``Global step N: {...}`` lines and its ``Evaluation completed ..., global_step N,
    eval_metrics: {...}`` lines (held-out metrics, merged into step N's row)."""
    rows: Rows = {}
    for line in text.splitlines():
        match = _OPENRLHF.search(line) or _OPENRLHF_EVAL.search(line)
        if match:
            _add(rows, match.group(1), _status(match.group(2)))
    return rows


def _csv_names(header: list[str]) -> dict[int, str]:
    """Column index -> key: W&B's bound columns dropped, a shared ``<run> - `` prefix and ``train/`` removed."""
    kept = {i: h.strip() for i, h in enumerate(header)
            if h.strip() and not h.strip().endswith(("__MIN", "__MAX")) and not h.strip().startswith("_")}
    if _shared_run(kept.values()) is not None:
        kept = {i: h.split(" - ", 1)[1] if " - " in h else h for i, h in kept.items()}
    names = set(kept.values())
    return {i: h[len("train/"):] if h.startswith("train/") and h[len("train/"):] not in names else h
            for i, h in kept.items()}


def _shared_run(columns: Iterable[str]) -> str | None:
    """The ``<run>`` of W&B's ``<run> - <key>`` when every column but the step carries the same one, else None."""
    named = [h for h in columns if h not in STEP_COLUMNS]
    runs = {h.split(" - ", 1)[0] for h in named if " - " in h}
    return runs.pop() if len(runs) == 1 and all(" - " in h for h in named) else None


def chart_run(text: str) -> str | None:
    """The run of a W&B chart export (``Download CSV`` on one panel: ``Step``, then ``<run> - <key>`` and its
    ``__MIN`` / ``__MAX`` bounds, every column under the same run), else None."""
    header = next(csv.reader(io.StringIO(text.split("\n", 1)[0])), [])
    return _shared_run(h.strip() for h in header if h.strip())


def parse_csv(text: str, name: str) -> Rows:
    """A W&B / TensorBoard export with a step column and one column per key."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header:
        raise ReplayInputError(f"{name}: empty CSV")
    clean = [h.strip() for h in header]
    step_col = next((clean.index(c) for c in STEP_COLUMNS if c in clean), None)
    if step_col is None:
        raise ReplayInputError(f"{name}: no step column (one of {', '.join(STEP_COLUMNS)})")
    names = {i: k for i, k in _csv_names(clean).items() if i != step_col}
    rows: Rows = {}
    for record in reader:
        if len(record) > step_col:
            _add(rows, record[step_col], {names[i]: record[i] for i in names if i < len(record) and record[i] != ""})
    return rows


def tensorboard_key(path: Path) -> str:
    """The tag of a TensorBoard export ``run-<run>-tag-<tag>.csv`` (its ``_``s as written), else the stem."""
    match = _TB_TAG.match(path.stem)
    return match.group(1) if match else path.stem


def parse_tensorboard_csv(text: str, name: str) -> Rows:
    """TensorBoard's per-tag export: ``Wall time,Step,Value``; the key from the file name."""
    reader = csv.DictReader(io.StringIO(text))
    key = tensorboard_key(Path(name))
    rows: Rows = {}
    for record in reader:
        _add(rows, record.get("Step"), {key: record.get("Value")})
    return rows


def is_swanlab(header: list[str]) -> bool:
    """Whether a CSV header is a SwanLab chart export's: ``step``, then only ``<run>-<key>_step`` columns."""
    named = header[1:]
    return header[:1] == [SWANLAB_STEP] and bool(named) and all(
        h.endswith(SWANLAB_END) and "-" in h[:-len(SWANLAB_END)].strip("-") for h in named)


def parse_swanlab(text: str, name: str) -> Rows:
    """A SwanLab chart export: each ``<run>-<key>_step`` column under ``<run>-<key>`` (all the runs'; one
    run is picked by :func:`swanlab_run`), the step from the ``step`` column."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None) or []
    if SWANLAB_STEP not in header:
        raise ReplayInputError(f"{name}: no {SWANLAB_STEP} column (not a SwanLab chart export)")
    at = header.index(SWANLAB_STEP)
    columns = {i: h[:-len(SWANLAB_END)] for i, h in enumerate(header) if i != at and h.endswith(SWANLAB_END)}
    rows: Rows = {}
    for record in reader:
        if len(record) > at:
            _add(rows, record[at], {columns[i]: record[i] for i in columns if i < len(record) and record[i] != ""})
    return rows


def _swanlab_key(columns: list[str]) -> str | None:
    """The key shared by one export's ``<run>-<key>`` columns: the longest suffix of every column that follows
    a ``-`` and starts with a letter (a run's name may end in ``lr1e-5``, a key be ``val-core/...``)."""
    first = columns[0]
    for at, char in enumerate(first):
        key = first[at + 1:]
        if char == "-" and key[:1].isalpha() and all(c.endswith("-" + key) and len(c) > len(key) + 1
                                                      for c in columns):
            return key
    return None


def swanlab_runs(columns_by_file: list[list[str]]) -> list[str]:
    """The run names in SwanLab exports, from each file's ``<run>-<key>`` columns: an export of several runs
    shares one key, the rest of each column is its run; a lone column is a run already found, else it is
    cut at its last ``-`` before the first ``/`` (``--run NAME`` is exact where names are ambiguous)."""
    runs: set[str] = set()
    lone: list[str] = []
    for columns in columns_by_file:
        columns = [c for c in columns if "-" in c.strip("-")]
        key = _swanlab_key(columns) if len(columns) > 1 else None
        if key is None:
            lone.extend(columns)
        else:
            runs.update(c[:-len(key) - 1] for c in columns)
    for column in lone:
        if not any(column.startswith(run + "-") for run in runs):
            head = column.split("/", 1)[0].rstrip("-")
            runs.add(column[:head.rfind("-")] if "-" in head.strip("-") else column[:column.rfind("-")])
    return sorted(runs)


def swanlab_run(rows: Rows, run: str, runs: list[str]) -> Rows:
    """``run``'s columns of ``rows`` (SwanLab exports read by :func:`parse_swanlab`) under their keys, the steps
    where it logged a value; a longer name of ``runs`` that begins with ``<run>-`` keeps its own columns."""
    start = run + "-"
    longer = tuple(r + "-" for r in runs if r.startswith(start))
    out: Rows = {}
    for step, row in rows.items():
        mine = {k[len(start):]: v for k, v in row.items() if k.startswith(start) and not k.startswith(longer)}
        if mine:
            out[step] = mine
    return out


PARSERS: dict[str, Callable[[str, str], Rows]] = {
    "trl": parse_trl, "verl-console": parse_verl_console, "verl-jsonl": parse_jsonl, "openrlhf": parse_openrlhf,
    "ms-swift": parse_msswift, "csv": parse_csv, "tensorboard-csv": parse_tensorboard_csv, "swanlab": parse_swanlab,
}


def detect(text: str, name: str) -> str:
    """The format of ``text`` (from its content, not its name)."""
    head = text.lstrip()[:4096]
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{") and first.endswith("}") and f'"{MSSWIFT_STEP}"' in text:
        return "ms-swift"           # before TRL's: ms-swift's closing summary carries a log_history
    if head.startswith("{") and '"log_history"' in text:
        return "trl"
    if first.startswith("{") and first.endswith("}"):
        return "verl-jsonl"
    if _VERL_STEP.search(text):
        return "verl-console"
    if _OPENRLHF.search(text):
        return "openrlhf"
    header = [h.strip() for h in next(csv.reader([first]), [])]
    if header[:3] == ["Wall time", "Step", "Value"]:
        return "tensorboard-csv"
    if is_swanlab(header):
        return "swanlab"
    if len(header) > 1 and any(h in STEP_COLUMNS for h in header):
        return "csv"
    raise ReplayInputError(f"{name}: not a format replay reads (TRL trainer_state.json, verl console or JSONL log, "
                           "OpenRLHF log, ms-swift logging.jsonl, W&B, TensorBoard or SwanLab CSV); --format "
                           "names one")


def resolve(path: Path) -> Path:
    """``path``, or for an output directory its ``trainer_state.json``, else ms-swift's ``logging.jsonl``
    (written at every logged step, where a checkpoint's state stops at the checkpoint), else the last
    checkpoint's ``trainer_state.json``."""
    if not path.is_dir():
        return path
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    if (path / MSSWIFT_LOG).is_file():
        return path / MSSWIFT_LOG
    checkpoints = [(int(p.name.split("-")[-1]), p) for p in path.glob("checkpoint-*")
                   if p.name.split("-")[-1].isdigit() and (p / "trainer_state.json").is_file()]
    return max(checkpoints)[1] / "trainer_state.json" if checkpoints else path


def read_text(path: Path) -> str:
    """The file's text; a missing, unreadable, binary or oversized file raises :class:`ReplayInputError`."""
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise ReplayInputError(f"{path}: a directory with no trainer_state.json or {MSSWIFT_LOG} (give the log "
                                   "file)")
        if size > MAX_BYTES:
            raise ReplayInputError(f"{path}: {size >> 20} MiB, over the {MAX_BYTES >> 20} MiB replay reads")
        data = path.read_bytes()
    except FileNotFoundError:
        raise ReplayInputError(f"{path}: not found") from None
    except OSError as exc:
        raise ReplayInputError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if b"\0" in data[:65536]:
        raise ReplayInputError(f"{path}: a binary file, not a text log (a TensorBoard event file: export its "
                               "scalars as CSV)")
    text = data.decode("utf-8", "replace")
    if not text.strip():
        raise ReplayInputError(f"{path}: empty")
    return text
