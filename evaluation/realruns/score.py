"""Score a replay of a corpus run against its authors' collapse step, and summarise a split.

- a collapse is *paged before* when a critical alert fires at a logged step strictly before the
  authors' collapse step, *warned before* when any alert (warning or critical) does; the lead is
  the collapse step minus that first firing step, in steps and as a fraction of the run (the last
  logged step);
- a healthy run is *paged* when any critical alert fires at any step;
- an alert *flaps* when it fires again within :data:`FLAP_ROWS` logged rows of resolving;
- an alert's precision over a split: of the collapsed and healthy runs it fired on, the share that
  are collapses (``precision``), and the share where it fired before the authors' collapse step
  (``precision_before``). Unresolved runs count in neither.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlwatch.replay import replay
from rlwatch.replay.run import first_fired

from . import observe
from .corpus import CorpusRun, load_run

#: An alert that fires again within this many logged rows of resolving flaps.
FLAP_ROWS = 5


@dataclass
class RunScore:
    """One run's replay against its authors' collapse step (steps are the log's own step numbers)."""

    id: str
    split: str
    source: str
    outcome: str
    collapse_step: int | None
    first_step: int
    last_step: int
    rows: int
    log_every: int
    first_page_step: int | None
    first_warning_step: int | None
    fired: list[tuple[int | None, str, str]] = field(default_factory=list)   # (step, alert, severity)
    flaps: int = 0
    postmortem_collapse_step: int | None = None

    def first_alert_step(self) -> int | None:
        steps = [s for s in (self.first_page_step, self.first_warning_step) if s is not None]
        return min(steps) if steps else None

    def before(self, step: int | None) -> bool:
        return step is not None and self.collapse_step is not None and step < self.collapse_step

    @property
    def paged_before(self) -> bool:
        return self.before(self.first_page_step)

    @property
    def warned_before(self) -> bool:
        return self.before(self.first_alert_step())

    def lead(self, step: int | None) -> tuple[int, float] | None:
        """(steps, fraction of the run) from ``step`` to the collapse, where ``step`` is before it."""
        if not self.before(step):
            return None
        assert step is not None and self.collapse_step is not None
        steps = self.collapse_step - step
        return steps, steps / max(self.last_step, 1)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(paged_before=self.paged_before, warned_before=self.warned_before,
                   page_lead=self.lead(self.first_page_step), alert_lead=self.lead(self.first_alert_step()))
        return out


def _flaps(events: list[tuple[int | None, str, str, str]], log_every: int) -> int:
    """Re-firings of one alert within FLAP_ROWS logged rows of its resolving."""
    count = 0
    resolved_at: dict[str, int] = {}
    for step, name, _severity, state in events:
        if step is None:
            continue
        if state == "resolved":
            resolved_at[name] = step
        elif name in resolved_at and step - resolved_at.pop(name) <= FLAP_ROWS * max(log_every, 1):
            count += 1
    return count


#: How a run reaches rlwatch: its log replayed (``log_scalars`` only), or fed as a custom loop would
#: (:mod:`evaluation.realruns.observe`: ``observe`` fields with the logged aggregates, the rest logged).
FEEDS = ("replay", "observe")


def score_run(entry: CorpusRun, store_dir: str | Path, overrides: dict[str, float] | None = None,
              feed: str = "replay") -> RunScore:
    """Replay ``entry`` (or feed it through ``observe``, ``feed="observe"``) at the shipped defaults
    (``overrides`` none) into ``store_dir`` and score it."""
    run = load_run(entry)
    collapse = None
    if feed == "observe":
        alerts = observe.feed(run, store_dir, f"realrun-observe-{entry.id}", overrides)
    else:
        result = replay(run, store_dir=store_dir, overrides=overrides, run_name=f"realrun-{entry.id}")
        alerts, collapse = result.alerts, result.collapse_step
    events = [(a.step, a.name, a.severity, a.state) for a in alerts]
    return RunScore(id=entry.id, split=entry.split, source=entry.source, outcome=entry.outcome,
                    collapse_step=entry.collapse_step, first_step=run.steps[0], last_step=run.steps[-1],
                    rows=len(run.steps), log_every=run.log_every, first_page_step=first_fired(alerts, "critical"),
                    first_warning_step=first_fired(alerts, "warning"),
                    fired=[(s, n, sev) for s, n, sev, st in events if st == "fired"],
                    flaps=_flaps(events, run.log_every), postmortem_collapse_step=collapse)


@dataclass
class Summary:
    """A split's figures (see the module docstring for the definitions)."""

    split: str
    collapses: int
    paged_before: int
    warned_before: int
    median_page_lead_steps: float | None
    median_page_lead_fraction: float | None
    median_alert_lead_steps: float | None
    healthy: int
    healthy_paged: int
    healthy_warned: int
    unresolved: int
    flaps: int
    alerts: dict[str, dict[str, Any]]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _alert_table(scores: list[RunScore]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for s in scores:
        if s.outcome == "unresolved":
            continue
        first: dict[str, int | None] = {}
        for step, name, severity in s.fired:
            first.setdefault(name, step)
            table.setdefault(name, {"severity": severity, "collapsed_runs": 0, "before_collapse": 0,
                                    "healthy_runs": 0})
        for name, step in first.items():
            row = table[name]
            if s.outcome == "collapsed":
                row["collapsed_runs"] += 1
                row["before_collapse"] += int(s.before(step))
            else:
                row["healthy_runs"] += 1
    for row in table.values():
        fired_on = row["collapsed_runs"] + row["healthy_runs"]
        row["precision"] = row["collapsed_runs"] / fired_on if fired_on else None
        row["precision_before"] = row["before_collapse"] / fired_on if fired_on else None
    return dict(sorted(table.items()))


def summarise(split: str, scores: list[RunScore]) -> Summary:
    """The figures of ``scores`` (the runs of one split)."""
    collapsed = [s for s in scores if s.outcome == "collapsed"]
    healthy = [s for s in scores if s.outcome == "healthy"]
    page_leads = [s.lead(s.first_page_step) for s in collapsed]
    alert_leads = [s.lead(s.first_alert_step()) for s in collapsed]
    return Summary(
        split=split, collapses=len(collapsed),
        paged_before=sum(s.paged_before for s in collapsed), warned_before=sum(s.warned_before for s in collapsed),
        median_page_lead_steps=_median([lead[0] for lead in page_leads if lead]),
        median_page_lead_fraction=_median([lead[1] for lead in page_leads if lead]),
        median_alert_lead_steps=_median([lead[0] for lead in alert_leads if lead]),
        healthy=len(healthy), healthy_paged=sum(s.first_page_step is not None for s in healthy),
        healthy_warned=sum(s.first_warning_step is not None for s in healthy),
        unresolved=sum(s.outcome == "unresolved" for s in scores), flaps=sum(s.flaps for s in scores),
        alerts=_alert_table(scores))
