"""A run's logged metrics as replay reads them: :class:`LoggedRun` and :func:`load` (the formats are in
:mod:`.formats`)."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .formats import (FORMATS, PARSERS, ReplayInputError, Rows, chart_run, detect, read_text, resolve, swanlab_run,
                      swanlab_runs, tensorboard_key)

#: Formats whose files given together are parts of one run (one tag or one metric a file).
PART_FORMATS = ("tensorboard-csv", "swanlab")

#: Sampler-learner mismatch aggregates trainers log (verl's ``rollout_corr/*`` and
#: ``training/rollout_probs_diff_*``, ms-swift's ``rollout_correction/*``, OpenRLHF's ``vllm_kl``,
#: ``token_mult_prob_error``, slime's ``*_logprob*_abs_diff*``): the ones :mod:`rlwatch.core.trainer_keys`
#: does not map onto an rlwatch signal have another definition and are kept under their own names; replay
#: lists them.
MISMATCH_AGGREGATE = re.compile(r"(?:^|/)(?:rollout_corr(?:ection)?/|rollout_probs_diff|vllm_kl|token_mult_prob_error)"
                                r"|logprobs?.*abs_diff")


def reward_keys() -> tuple[str, ...]:
    """The trainers' own names for the training reward, best first (the ``reward_mean`` rows of
    :data:`rlwatch.core.trainer_keys.TRAINER_KEYS`, each also after a tracker's ``train/`` prefix);
    ``--reward KEY`` names any other."""
    from ..core.trainer_keys import PREFIXES, keys_for

    names = [k.key for k in keys_for("reward_mean") if k.key]
    return tuple(names + [p + n for n in names for p in PREFIXES])


@dataclass
class LoggedRun:
    """One run's logged metrics: ``rows[i]`` holds the finite values logged at ``steps[i]`` (ascending),
    under the framework's own key names; ``log_every`` the usual distance between logged steps (the
    most common one); ``nonfinite`` the steps where a key was logged NaN or infinite (left out of
    the rows); ``reward_key`` the key the reward curve is read from (None: none recognised); ``name`` the
    run's own name where several files of one run carry it (SwanLab and W&B chart exports)."""

    source: str
    fmt: str
    steps: list[int]
    rows: list[dict[str, float]]
    log_every: int
    reward_key: str | None = None
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    name: str | None = None

    def series(self, key: str) -> list[tuple[int, float]]:
        """``[(step, value)]`` of ``key`` where it was logged."""
        return [(s, row[key]) for s, row in zip(self.steps, self.rows) if key in row]

    def fed_rows(self) -> list[dict[str, float]]:
        """The rows as replay feeds them to ``log_scalars``: the non-finite values put back (a NaN loss
        or gradient norm is a signal), and a ``reward_key`` that is not a recognised reward name also
        given under TRL's ``reward`` (so that it is the run's reward, in the alerts and the post-mortem)."""
        bad: dict[int, dict[str, float]] = {}
        for key, steps in self.nonfinite.items():
            for step in steps:
                bad.setdefault(step, {})[key] = math.nan
        alias = self.reward_key is not None and self.reward_key not in reward_keys()
        out = []
        for step, row in zip(self.steps, self.rows):
            fed = {**row, **bad.get(step, {})}
            if alias and self.reward_key in row:
                fed = {"reward": row[self.reward_key], **{k: v for k, v in fed.items() if k != "reward"}}
            out.append(fed)
        return out

    def recognised(self) -> dict[str, str]:
        """``{logged key: rlwatch signal}`` for the keys :mod:`rlwatch.core.trainer_keys` reads as
        rlwatch's signals (the first key of a signal in the table's order wins, as there); the others
        are kept as framework scalars under their own names. A ``--reward`` key reads as the reward."""
        from ..core.trainer_keys import PREFIXES, TRAINER_KEYS

        keys = self.keys
        plain = {k: next((k[len(p):] for p in PREFIXES if k.startswith(p)), k) for k in keys}
        out: dict[str, str] = {}
        taken: set[str] = set()
        if self.reward_key is not None and self.reward_key not in reward_keys():
            out[self.reward_key] = "reward_mean"
            taken.add("reward_mean")
        for entry in TRAINER_KEYS:
            if entry.signal in taken:
                continue
            found = [k for k in keys if entry.matches(plain[k]) and k not in out]
            if found:
                out.update({k: entry.signal for k in (found if entry.pattern else found[:1])})
                taken.add(entry.signal)
        return out

    def kept_mismatch_aggregates(self) -> list[str]:
        """The logged mismatch aggregates (:data:`MISMATCH_AGGREGATE`) not read as an rlwatch signal."""
        recognised = self.recognised()
        return [k for k in self.keys if MISMATCH_AGGREGATE.search(k) and k not in recognised]

    @property
    def keys(self) -> list[str]:
        return sorted({k for row in self.rows for k in row})


def _log_every(steps: list[int]) -> int:
    gaps = Counter(b - a for a, b in zip(steps, steps[1:]) if b > a)
    return gaps.most_common(1)[0][0] if gaps else 1


def _reward_key(keys: set[str], reward_key: str | None, source: str) -> str | None:
    if reward_key is not None:
        if reward_key not in keys:
            near = sorted(k for k in keys if "reward" in k.lower() or "score" in k.lower())[:6]
            raise ReplayInputError(f"{source}: no key {reward_key!r} logged"
                                   + (f" (reward-like keys: {', '.join(near)})" if near else ""))
        return reward_key
    return next((k for k in reward_keys() if k in keys), None)


def from_rows(rows: Rows, source: str, fmt: str, reward_key: str | None = None, name: str | None = None
              ) -> LoggedRun:
    """A :class:`LoggedRun` from ``{step: {key: value}}``; no step logged raises :class:`ReplayInputError`."""
    if not rows:
        raise ReplayInputError(f"{source}: no logged step found in this {fmt} file")
    steps = sorted(rows)
    nonfinite: dict[str, list[int]] = {}
    clean = []
    for step in steps:
        for key, value in rows[step].items():
            if not math.isfinite(value):
                nonfinite.setdefault(key, []).append(step)
        clean.append({k: v for k, v in rows[step].items() if math.isfinite(v)})
    keys = {k for row in clean for k in row}
    return LoggedRun(source=source, fmt=fmt, steps=steps, rows=clean, log_every=_log_every(steps),
                     reward_key=_reward_key(keys, reward_key, source), nonfinite=nonfinite, name=name)


def _parse(path: Path, fmt: str | None) -> tuple[str, str, Rows, str | None]:
    """(source, format, rows, the run of a W&B chart export or None)."""
    if fmt is not None and fmt not in FORMATS:
        raise ReplayInputError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    path = resolve(path)
    text = read_text(path)
    fmt = fmt or detect(text, str(path))
    return str(path), fmt, PARSERS[fmt](text, str(path)), chart_run(text) if fmt == "csv" else None


def load(path: str | Path, *, reward_key: str | None = None, fmt: str | None = None, run: str | None = None
         ) -> LoggedRun:
    """Read one logged run from ``path`` (format detected from the content unless ``fmt`` names one
    of :data:`~rlwatch.replay.formats.FORMATS`; ``run``: the run of a SwanLab export of several). Raises
    :class:`ReplayInputError` (one line) on a missing, empty, malformed or unknown file."""
    source, fmt, rows, _ = _parse(Path(path), fmt)
    if fmt == "swanlab":
        logged = _merged((fmt, ""), rows, [source], reward_key, run, [_columns(rows)])
        if isinstance(logged, ReplayInputError):
            raise logged
        return logged
    return from_rows(rows, source, fmt, reward_key)


def load_all(paths: list[str], *, reward_key: str | None = None, fmt: str | None = None, run: str | None = None
             ) -> list[LoggedRun | ReplayInputError]:
    """Each file its own run, except the parts of one run given file by file, merged into one (in the place
    of the first): TensorBoard per-tag exports (``Wall time,Step,Value``, their keys from the file names),
    SwanLab chart exports (one metric for several runs a file: the columns of ``run``, which may be left out
    when the exports hold one run) and W&B chart exports of the same run (one panel's ``Download CSV`` each;
    an export whose keys the run already has is a run of its own, another run of that name). A file that
    cannot be read is its :class:`ReplayInputError` in the list, in the files' order."""
    out: list[LoggedRun | ReplayInputError | tuple[str, str]] = []
    parts: dict[tuple[str, str], tuple[Rows, list[str]]] = {}
    swanlab_columns: list[list[str]] = []
    for path in paths:
        try:
            source, kind, rows, chart = _parse(Path(path), fmt)
        except ReplayInputError as exc:
            out.append(exc)
            continue
        key = (kind, chart or "")
        if kind in PART_FORMATS or (chart is not None and not _overlaps(parts.get(key), rows)):
            if key not in parts:
                parts[key] = ({}, [])
                out.append(key)
            merged, files = parts[key]
            for step, row in rows.items():
                merged.setdefault(step, {}).update(row)
            files.append(source)
            if kind == "swanlab":
                swanlab_columns.append(_columns(rows))
            continue
        try:
            out.append(from_rows(rows, source, kind, reward_key))
        except ReplayInputError as exc:
            out.append(exc)
    return [_merged(item, *parts[item], reward_key, run, swanlab_columns) if isinstance(item, tuple) else item
            for item in out]


def _columns(rows: Rows) -> list[str]:
    return sorted({k for row in rows.values() for k in row})


def _overlaps(part: tuple[Rows, list[str]] | None, rows: Rows) -> bool:
    """Whether ``rows`` log a key the part already has (two exports of runs that share a name: kept apart)."""
    if part is None:
        return False
    have = {k for row in part[0].values() for k in row}
    return any(k in have for row in rows.values() for k in row)


def _merged(key: tuple[str, str], rows: Rows, files: list[str], reward_key: str | None, run: str | None = None,
            swanlab_columns: list[list[str]] | None = None) -> LoggedRun | ReplayInputError:
    kind, chart = key
    names = [tensorboard_key(Path(p)) if kind == "tensorboard-csv" else Path(p).name for p in files]
    listed = f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
    name = None
    try:
        if kind == "swanlab":
            name, rows = _swanlab(rows, files, run, swanlab_columns or [])
            source = f"{len(files)} SwanLab export{'s' if len(files) > 1 else ''} of {name} ({listed})"
        elif len(files) == 1:
            source = files[0]
        elif kind == "tensorboard-csv":
            source = f"{len(files)} TensorBoard tag files ({listed})"
        else:
            name, source = chart, f"{len(files)} W&B chart exports of {chart} ({listed})"
        return from_rows(rows, source, kind, reward_key, name)
    except ReplayInputError as exc:
        return exc


def _swanlab(rows: Rows, files: list[str], run: str | None, columns: list[list[str]]) -> tuple[str, Rows]:
    """(the run, its rows) of SwanLab exports; no run named where they hold several, or a run they do not
    hold, raises :class:`ReplayInputError` listing the runs found."""
    found = swanlab_runs(columns)
    where = f"{len(files)} SwanLab export{'s' if len(files) > 1 else ''}"
    if run is None and len(found) != 1:
        raise ReplayInputError(f"{where} hold {len(found)} runs, give one with --run NAME: {', '.join(found)}")
    run = found[0] if run is None else run
    mine = swanlab_run(rows, run, found)
    if not mine:
        raise ReplayInputError(f"{where} hold no run {run!r}; the runs found: {', '.join(found)}")
    return run, mine
