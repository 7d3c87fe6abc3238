"""A discrete-event simulation of a rollout pipeline (section 13.3 of chapter 13 of the Agent RL tutorial,
"Rollout Systems and Off-Policy Correction", agent-rl.tacetai.com).

``slots`` generation slots run episodes concurrently; one trainer takes the ``batch_size`` oldest
finished episodes whenever it is free and trains for ``train_s`` seconds; then the new weights are
synchronised for ``sync_s`` seconds, during which no episode starts and in-flight ones pause. A
staleness bound ``eta`` lets an episode start only while fewer than ``(version + 1 + eta) *
batch_size`` have started (AReaL's count-based throttle): ``eta = 0`` is the synchronous design.
A finished step's sync either starts at once, pausing the in-flight episodes, which finish under
newer weights (partial rollouts), or waits until every in-flight episode has finished and starts
none meanwhile (draining). The run ends when ``steps`` versions have been published.

Time jumps from event to event (an episode, a training step or a sync finishing). In-flight
episodes sit in a heap keyed by their end on a generation clock that stops during syncs (wall
time minus the pauses so far), so a sync shifts every in-flight end at once without touching the
heap. Durations are taken in order from one sequence, so every design sees the same episodes.

Measured per design: trained episodes per hour, slot utilisation (the busy share of slot time,
an interrupted episode's pause counted as busy), and the staleness of each trained episode (the
trainer's version when its step starts minus the version that started the episode).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator


@dataclass(frozen=True)
class Pipeline:
    """The pipeline's shape: generation slots, episodes per step, seconds per training step and
    per weight sync, steps simulated."""

    slots: int = 64
    batch_size: int = 64
    train_s: float = 60.0
    sync_s: float = 10.0
    steps: int = 20

    def __post_init__(self) -> None:
        if self.slots < 1 or self.batch_size < 1 or self.steps < 1:
            raise ValueError(f"slots, batch_size and steps must be positive: {self}")
        if not (0 <= self.train_s < math.inf and 0 <= self.sync_s < math.inf):
            raise ValueError(f"train_s and sync_s must be finite and non-negative: {self}")


@dataclass(frozen=True)
class Design:
    """A pipeline design: the staleness bound ``eta`` (batches generation may run ahead of
    training; 0 is synchronous) and what a sync does to in-flight episodes (``partial``: pause
    them and let them finish under the new weights; else drain them first)."""

    name: str
    eta: int
    partial: bool

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0: {self.eta}")


SYNCHRONOUS = Design("synchronous", 0, partial=False)
ONE_STEP_AHEAD = Design("one step ahead, drain", 1, partial=False)


def asynchronous(eta: int, partial: bool) -> Design:
    """The asynchronous design with staleness bound ``eta``, partial rollouts or draining."""
    return Design(f"async eta={eta}, {'partial' if partial else 'drain'}", eta, partial)


#: The designs ``rlwatch whatif`` compares: synchronous, one step ahead, and asynchronous at
#: eta = 1, 2, 4, 8 with partial rollouts and with draining (eta = 1 with draining is one step ahead).
DESIGNS: tuple[Design, ...] = (
    SYNCHRONOUS, ONE_STEP_AHEAD,
    *(asynchronous(eta, partial=True) for eta in (1, 2, 4, 8)),
    *(asynchronous(eta, partial=False) for eta in (2, 4, 8)),
)


@dataclass(frozen=True)
class Outcome:
    """What one design did. ``throughput``: trained episodes per hour; ``utilisation``: busy share
    of slot time (0..1); ``staleness_*``: over trained episodes (versions); durations in seconds
    (``trained_duration``: mean over trained episodes, ``launched_duration``: over every started one)."""

    design: Design
    seconds: float
    throughput: float
    utilisation: float
    staleness_mean: float
    staleness_max: int
    trained_duration: float
    launched_duration: float
    launched: int
    trained: int


def episodes_needed(pipeline: Pipeline, design: Design) -> int:
    """The most episodes a run can start: the throttle allows ``(steps + eta) * batch_size``."""
    return (pipeline.steps + design.eta) * pipeline.batch_size


class _Simulation:
    """The state of one simulated run; :func:`simulate` drives it."""

    def __init__(self, durations: Iterator[float], pipeline: Pipeline, design: Design) -> None:
        self.durations, self.pipeline, self.design = durations, pipeline, design
        self.now = 0.0
        self.version = 0                  # weights the engine samples with
        self.started = 0
        self.launched_s = 0.0             # summed durations of the started episodes
        self.paused = 0.0                 # seconds of generation paused by syncs so far
        self.ids = itertools.count()      # breaks ties in the heap
        # (end on the generation clock, id, wall start, version that started it, duration)
        self.in_flight: list[tuple[float, int, float, int, float]] = []
        self.finished: deque[tuple[int, float]] = deque()      # (version, duration), oldest first
        self.train_end: float | None = None
        self.sync_end: float | None = None
        self.awaiting_sync = False        # a step is trained; its weights are not yet synchronised
        self.staleness: list[int] = []
        self.trained_s = 0.0
        self.busy_s = 0.0

    def launch(self) -> None:
        """Fill free slots while the throttle allows and no sync runs (or, draining, waits)."""
        p, d = self.pipeline, self.design
        if self.sync_end is not None or (self.awaiting_sync and not d.partial):
            return
        limit = (self.version + 1 + d.eta) * p.batch_size
        while len(self.in_flight) < p.slots and self.started < limit:
            duration = next(self.durations, None)
            if duration is None:
                raise ValueError(f"ran out of durations after {self.started}; give at least "
                                 f"{episodes_needed(p, d)}")
            start_on_clock = self.now - self.paused
            heapq.heappush(self.in_flight, (start_on_clock + duration, next(self.ids), self.now, self.version,
                                            duration))
            self.started += 1
            self.launched_s += duration

    def train(self) -> None:
        """Start a step on the oldest finished batch when the trainer is free and no sync is due."""
        p = self.pipeline
        if self.train_end is not None or self.sync_end is not None or self.awaiting_sync:
            return
        if len(self.finished) < p.batch_size:
            return
        for _ in range(p.batch_size):
            version, duration = self.finished.popleft()
            self.staleness.append(self.version - version)
            self.trained_s += duration
        self.train_end = self.now + p.train_s

    def advance(self) -> None:
        """Jump to the next event and apply it: a sync publishes a version, a trained step asks for
        a sync, finished episodes join the buffer; then a requested sync starts if it may."""
        pending = [t for t in (self.train_end, self.sync_end) if t is not None]
        if self.in_flight:
            pending.append(self.in_flight[0][0] + self.paused)
        if not pending:
            raise RuntimeError("the pipeline stalled: no episode, training step or sync pending")
        self.now = min(pending)
        if self.sync_end is not None and self.sync_end <= self.now:
            self.sync_end, self.version = None, self.version + 1
        if self.train_end is not None and self.train_end <= self.now:
            self.train_end, self.awaiting_sync = None, True
        while self.in_flight and self.in_flight[0][0] + self.paused <= self.now:
            _, _, wall_start, version, duration = heapq.heappop(self.in_flight)
            self.busy_s += self.now - wall_start
            self.finished.append((version, duration))
        if self.awaiting_sync and (self.design.partial or not self.in_flight):
            self.awaiting_sync = False
            self.sync_end = self.now + self.pipeline.sync_s
            self.paused += self.pipeline.sync_s          # in-flight episodes pause

    def outcome(self) -> Outcome:
        p, n = self.pipeline, len(self.staleness)
        return Outcome(self.design, self.now, p.steps * p.batch_size / self.now * 3600.0,
                       self.busy_s / (p.slots * self.now), sum(self.staleness) / n, max(self.staleness),
                       self.trained_s / n, self.launched_s / self.started, self.started, n)


def simulate(durations: Iterable[float], pipeline: Pipeline, design: Design) -> Outcome:
    """Simulate ``design`` on ``pipeline`` with episode durations (seconds) taken in order from
    ``durations`` (at least :func:`episodes_needed` of them)."""
    run = _Simulation(iter(float(d) for d in durations), pipeline, design)
    while run.version < pipeline.steps:
        run.launch()
        run.train()
        run.advance()
    return run.outcome()


def compare(durations: Iterable[float], pipeline: Pipeline,
            designs: Iterable[Design] = DESIGNS) -> list[Outcome]:
    """Every design on the same episodes."""
    pool = [float(d) for d in durations]
    return [simulate(pool, pipeline, design) for design in designs]
