"""What an alert of the catalogue is: its definition (:class:`Alert`), its runbook section and
the example its promtool tests replay.

A step-window alert has a ``condition`` (read in the training process, see
:mod:`rlwatch.alerts.windows`) and a rule that pages on the incidents the process exports
(``rlwatch_alert_incident``); a wall-clock alert has only a Prometheus expression (``prom_expr``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..signals.ranges import Ranged
from .history import History, LabelSet, Verdicts

#: the runbook every rlwatch exporter serves (the copy shipped in the package); RLWATCH_RUNBOOK_URL
#: overrides it (runbook_base)
RUNBOOK_BASE = "http://127.0.0.1:9400/runbook"

#: The labels that identify one exporting process's series (every rule joins on them).
RUN_IDENTITY = ("run", "run_instance")
#: A resolved incident that no scrape saw open fires while its series is younger than this (longer
#: than any evaluation interval), so an incident that opened and resolved between two scrapes pages once.
INCIDENT_UNSEEN_WINDOW = "2m"
#: keep_firing_for of the step-window alerts: longer than Alertmanager's group_wait, so an incident
#: that only the last scrape of a run saw still reaches the receiver once the exporter is gone.
INCIDENT_KEEP_FIRING_MINUTES = 1


def runbook_base(explicit: str | None = None) -> str:
    """The runbook's base URL: ``explicit``, else $RLWATCH_RUNBOOK_URL, else :data:`RUNBOOK_BASE`."""
    from ..core.config import runbook_url

    return runbook_url(explicit, RUNBOOK_BASE)


@dataclass(frozen=True)
class Param(Ranged):
    """A threshold: its default, its meaning, and the values a run may set: from ``low`` (or
    strictly above ``above``) to ``high`` (or strictly below ``below``), finite (:class:`Ranged`). Declared
    in the ``PARAMS`` of the domain module whose alerts read it (the shared ones in :mod:`.params`)."""

    default: float
    doc: str
    low: float = 0.0
    high: float = math.inf
    above: float | None = None
    below: float | None = None


def threshold_expr(param: str, default: float) -> str:
    """PromQL for the value of ``param`` per process (run, run_instance): a Prometheus-side override
    of the run (``source="overrides"``, ``alerts/overrides.example.yaml``; it applies to every process
    of that run name), else the value the process exports, else ``default``. One series per (run,
    run_instance) whatever Prometheus scrapes (``max by``): two targets behind one identity (one
    $RLWATCH_RUN_INSTANCE given to two processes, a target scraped by two jobs) would otherwise make
    the rule's ``on(run, run_instance)`` join fail ("found duplicate series") for every run."""
    series = f'rlwatch_alert_threshold{{param="{param}"'
    return (f'max by(run, run_instance) ('
            f'max by(run) ({series}, source="overrides"}}) * on(run) group_right() (0 * rlwatch_step + 1) '
            f'or on(run, run_instance) {series}, source!="overrides"}} '
            f'or on(run, run_instance) (0 * rlwatch_step + {default:g}))')


#: What an alert indicates, for the readers that group alerts (the post-mortem,
#: :mod:`rlwatch.postmortem.analysis`); an alert declares its roles (``Alert(roles=...)``).
ROLES: dict[str, str] = {
    "mismatch": "a sampler-learner mismatch: firing makes a diagnosed cause the run's cause even where the run "
                "did not degrade",
    "lag": "a lag fault (stale tokens, a version lag); also a mismatch alert",
    "kl": "the KL between sampler and learner spiked, jumped or drifted; also a mismatch alert",
    "importance": "the importance weights of a correction (truncated, degenerate); also a mismatch alert",
}


@dataclass(frozen=True)
class Runbook:
    meaning: str
    causes: list[str]
    look: list[str]
    do: list[str]


@dataclass(frozen=True)
class Example:
    """Series sampled once a minute in which a Prometheus-only alert fires at minute ``fires_at``
    with ``labels``; None in a series is a missing sample."""

    series: dict[str, list[float | None]]
    fires_at: int
    labels: LabelSet
    value: float


@dataclass(frozen=True)
class StepExample:
    """A step-window alert's example: per-step rlwatch values ({metric: {label values: [value per
    step, None = missing]}}, counters as per-step increments) in which the alert opens at step
    ``fires_at`` with ``labels`` (run excluded) and ``value``; ``case`` names a further example of
    the same alert."""

    series: dict[str, dict[tuple[str, ...], list[float | None]]]
    fires_at: int
    labels: LabelSet
    value: float
    case: str = ""

    @property
    def length(self) -> int:
        return max(len(v) for family in self.series.values() for v in family.values())

    def steps(self) -> list[tuple[int, dict]]:
        out: list[tuple[int, dict]] = [(i, {}) for i in range(self.length)]
        for name, family in self.series.items():
            for labels, values in family.items():
                for i, v in enumerate(values):
                    if v is not None:
                        out[i][1].setdefault(name, {})[labels] = v
        return out


#: Label names of the exported alert statistics, in order; unused ones are "".
ALERT_LABELS: tuple[str, ...] = ("alert", "signal", "env", "detector", "kind")


@dataclass(frozen=True)
class Alert:
    """One alert. ``condition`` (step-window alerts) reads the latest steps; the alert opens after
    ``for_steps`` consecutive raise steps or, when ``intermittent``, after ``intermittent_hits`` raise
    steps among the last ``intermittent_steps``. ``prom_expr``: a wall-clock alert's own rule.
    ``more_examples``: further step-window examples its promtool tests replay. ``roles``: what the
    alert indicates (:data:`ROLES`), read by the post-mortem. ``value_format``: its value named, with its unit."""

    name: str
    severity: str
    summary: str
    description: str
    runbook: Runbook
    windows: str
    condition: Callable[[History], Verdicts] | None = None
    for_steps: int = 1
    prom_expr: str = ""
    for_minutes: int = 0
    keep_firing_minutes: int = 0
    example: Example | StepExample | None = None
    embedded_note: str = ""
    params: tuple[str, ...] = ()
    labels: tuple[str, ...] = ("run",)
    intermittent: bool = False
    more_examples: tuple[StepExample, ...] = ()
    roles: tuple[str, ...] = ()
    #: The value of its events in one phrase with its name and unit, a ``str.format`` of the value
    #: ("k3 {:.4g} nats"): what the console, the trainer's log, chat and the landing page print.
    value_format: str = "value {:.4g}"

    def __post_init__(self) -> None:
        if self.value_format and self.value_format.count("{") != 1:
            raise ValueError(f"alert {self.name}: value_format names the value around exactly one {{}}")
        unknown = [role for role in self.roles if role not in ROLES]
        if unknown:
            raise ValueError(f"alert {self.name}: unknown role(s) {unknown} (known: {', '.join(ROLES)})")

    @property
    def examples(self) -> tuple[Example | StepExample, ...]:
        return ((self.example,) if self.example is not None else ()) + self.more_examples

    @property
    def step_labels(self) -> tuple[str, ...]:
        """The alert's labels other than run, in the order of its verdict keys."""
        return tuple(label for label in self.labels if label != "run")

    @property
    def expr(self) -> str:
        """The rule: an open incident fires; a resolved one fires only when it is new and no scrape
        saw it open (it opened and resolved between two scrapes)."""
        if self.condition is None:
            return self.prom_expr
        on = ", ".join(RUN_IDENTITY + ALERT_LABELS + ("incident",))
        series = f'rlwatch_alert_incident{{alert="{self.name}"'
        window = INCIDENT_UNSEEN_WINDOW
        return (f'max without (alert, state) (\n'
                f'  {series},state="open"}}\n'
                f'  or ({series},state="resolved"}}\n'
                f'      unless on({on}) {series}}} offset {window}\n'
                f'      unless on({on}) max_over_time({series},state="open"}}[{window}]))\n'
                f')')

    @property
    def keep_firing(self) -> int:
        """keep_firing_for in minutes (the step-window alerts: :data:`INCIDENT_KEEP_FIRING_MINUTES`)."""
        return self.keep_firing_minutes or (INCIDENT_KEEP_FIRING_MINUTES if self.condition is not None else 0)

    @property
    def runbook_url(self) -> str:
        return f"{runbook_base()}#{self.name.lower()}"

    @property
    def group(self) -> str:
        return "rlwatch-" + ("health" if self.condition is None else "signals")


# --- helpers of the examples --------------------------------------------------------------------

def const(value: float, n: int) -> list[float]:
    return [value] * n


def cumulative(increments: list[float]) -> list[float]:
    out, total = [], 0.0
    for inc in increments:
        total += inc
        out.append(total)
    return out


def with_step(n: int, **families: dict) -> dict:
    """An example's series with the ``step`` gauge counting 0 .. n-1."""
    return {"step": {(): [float(i) for i in range(n)]}, **families}


#: The run label of the examples' Prometheus series.
R1 = 'run="r1"'


__all__ = ["ALERT_LABELS", "R1", "ROLES", "RUNBOOK_BASE", "Alert", "Example", "Param", "Runbook", "StepExample",
           "const", "cumulative", "runbook_base", "threshold_expr", "with_step"]
