"""Replay a logged run through a :class:`rlwatch.Watch` and the post-mortem: :func:`replay`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from ..alerts.notify import quiet_alert_log
from .logged import LoggedRun

def treatment(log_every: int) -> str:
    """What each logged row is to the evaluator (said in the output and in docs/replay.md)."""
    if log_every <= 1:
        return "each logged row is one evaluation step at its own step number (logged every step)"
    return (f"logged every {log_every} steps: each row (the trainer's means over {log_every} steps) is one "
            f"evaluation step at its own step number; alert windows count rows, so a window of n rows spans "
            f"n x {log_every} trainer steps")


class AlertEntry(NamedTuple):
    """One alert event of the replay: the logged step it came at, the alert, its severity
    (``critical`` pages, ``warning`` warns) and ``fired`` or ``resolved``."""

    step: int | None
    name: str
    severity: str
    state: str


@dataclass
class ReplayResult:
    """What the replay found: the alert events in order, the first step that paged and warned, the
    collapse the post-mortem dated (None: none), its JSON document and the run store written."""

    run: LoggedRun
    alerts: list[AlertEntry]
    first_page_step: int | None
    first_warning_step: int | None
    collapse_step: int | None
    postmortem: dict[str, Any]
    store_path: str
    report: Any = field(default=None, repr=False)      # the post-mortem's Report, for the text

    def as_json(self) -> dict[str, Any]:
        """The post-mortem's document with the replay's own fields added under ``replay``."""
        run = self.run
        return {**self.postmortem, "replay": {
            "source": run.source, "format": run.fmt, "logged_rows": len(run.steps),
            "steps": [run.steps[0], run.steps[-1]], "log_every": run.log_every, "reward_key": run.reward_key,
            "recognised": run.recognised(), "kept_mismatch_aggregates": run.kept_mismatch_aggregates(),
            "treatment": treatment(run.log_every),
            "first_page_step": self.first_page_step, "first_warning_step": self.first_warning_step,
            "collapse_step": self.collapse_step,
            "alerts": [e._asdict() for e in self.alerts],
            "nonfinite": run.nonfinite, "store": self.store_path}}


def run_name_for(source: str, name: str | None = None) -> str:
    """``replay-<the run's name>`` (``name``, where the files carry it), else ``replay-<file stem>``, with
    characters outside ``[A-Za-z0-9_.-]`` as ``_`` (a name whose last ``.`` starts no file extension, a run's
    ``ent0.01_lr1e-5``, kept whole)."""
    if name is None:
        path = Path(source.split(" (")[0])
        name = (path.stem if re.fullmatch(r"\.[A-Za-z0-9]{1,10}", path.suffix) else path.name) or "run"
    return "replay-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80]


def alert_entries(alerts: list[dict[str, Any]]) -> list[AlertEntry]:
    """A run store's alert events (``RunData.alerts``) as :class:`AlertEntry` s, in order."""
    return [AlertEntry(a.get("step"), str(a["name"]), str(a.get("severity") or ""),
                       "fired" if a.get("state", "firing") == "firing" else "resolved") for a in alerts]


def first_fired(alerts: list[AlertEntry], severity: str) -> int | None:
    """The first logged step at which an alert of ``severity`` fired (None: none did)."""
    steps = [a.step for a in alerts if a.severity == severity and a.state == "fired" and a.step is not None]
    return min(steps) if steps else None


def fresh_store(store_dir: str | Path, name: str) -> Path:
    directory = Path(store_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.db"
    for stale in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        stale.unlink(missing_ok=True)          # a replay's own store from an earlier replay of the same name
    return path


def _feed(run: LoggedRun, name: str, store: Path, overrides: Mapping[str, float] | None) -> None:
    with quiet_alert_log():
        _feed_watch(run, name, store, overrides)


def _feed_watch(run: LoggedRun, name: str, store: Path, overrides: Mapping[str, float] | None) -> None:
    from ..hook.watch import Watch

    watch = Watch(run=name, port=None, store=str(store), alerts=True, sd_dir="", hack_detectors=False,
                  background=False, alert_overrides=dict(overrides or {}), framework="replay",
                  metadata={"replay": {"source": run.source, "format": run.fmt, "log_every": run.log_every}})
    try:
        for step, row in zip(run.steps, run.fed_rows()):
            watch.log_scalars(step, row)
    finally:
        watch.close()


def replay(run: LoggedRun, *, store_dir: str | Path, overrides: Mapping[str, float] | None = None,
           run_name: str | None = None) -> ReplayResult:
    """Feed ``run``'s rows to a Watch (no endpoint, no registration, inline, the shipped alert
    defaults with ``overrides``), one :meth:`~rlwatch.Watch.log_scalars` per logged step, into a
    fresh store ``<store_dir>/<run_name>.db``; then read the alert events back and run the
    post-mortem on the store, the collapse dated on the run's reward (``run.reward_key``) where the
    store carries no reward or held-out score of its own. ``overrides``: alert parameters
    (``rlwatch.alerts.catalogue.PARAMS``); an unknown one raises ValueError."""
    from ..postmortem import analyse, load as load_store
    from ..postmortem.analysis import quality_series

    name = run_name or run_name_for(run.source, run.name)
    store = fresh_store(store_dir, name)
    _feed(run, name, store, overrides)
    data = load_store(str(store), run=name)
    data.source = f"replay of {run.source}"
    if quality_series(data)[0] is None and run.reward_key is not None:
        data.scalars["reward_mean"] = run.series(run.reward_key)     # a store without the judged reward
    report = analyse(data)
    if report.quality_signal == "reward_mean" and run.reward_key is not None:
        report.quality_signal = run.reward_key          # the reward, by the name the run logged it under
    if report.steps is None:
        report.steps = (run.steps[0], run.steps[-1])
    alerts = alert_entries(data.alerts)
    return ReplayResult(run=run, alerts=alerts, first_page_step=first_fired(alerts, "critical"),
                        first_warning_step=first_fired(alerts, "warning"),
                        collapse_step=report.collapse_step, postmortem=report.as_json(), store_path=str(store),
                        report=report)
