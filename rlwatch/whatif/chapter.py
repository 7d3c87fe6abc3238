"""The figures of chapter 13 of the Agent RL tutorial ("Rollout Systems and Off-Policy Correction",
agent-rl.tacetai.com; sections 13.2, 13.3, 13.7), recomputed with this package's
duration model and simulator next to the printed ones: ``rlwatch whatif --chapter``.

Every figure is recomputed on the chapter's pool (:func:`~rlwatch.whatif.model.chapter_durations`)
with the chapter's pipeline (64 slots, 64 episodes per step, 60 s training, 10 s sync, 20 steps).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from .model import chapter_durations, failure_bias, straggler_ratio, summarise
from .simulate import ONE_STEP_AHEAD, SYNCHRONOUS, Design, Outcome, Pipeline, asynchronous, simulate

#: The chapter's pipeline table (section 13.3): design -> (episodes/hour, slot utilisation,
#: staleness mean, staleness max, trained episode mean [s]).
CHAPTER_TABLE: dict[Design, tuple[float, float, float, int, float]] = {
    SYNCHRONOUS: (451, 0.19, 0.00, 0, 97.7),
    ONE_STEP_AHEAD: (506, 0.22, 0.95, 1, 97.7),
    asynchronous(1, partial=True): (1836, 0.81, 0.93, 5, 94.1),
    asynchronous(2, partial=True): (2077, 0.95, 1.50, 7, 93.2),
    asynchronous(4, partial=False): (490, 0.25, 3.19, 4, 97.7),
}


@dataclass(frozen=True)
class Figure:
    """One printed figure and its recomputation."""

    section: str
    what: str
    chapter: float
    reproduced: float

    @property
    def error(self) -> float:
        """Relative error (0 when both are 0)."""
        if self.chapter == 0:
            return abs(self.reproduced)
        return abs(self.reproduced - self.chapter) / abs(self.chapter)


def _pipeline_figures(pool: list[float]) -> list[Figure]:
    figures = []
    for design, (throughput, utilisation, mean, top, trained) in CHAPTER_TABLE.items():
        o = simulate(pool, Pipeline(), design)
        figures += [Figure("13.3", f"{design.name}: episodes/hour", throughput, o.throughput),
                    Figure("13.3", f"{design.name}: slot utilisation", utilisation, o.utilisation),
                    Figure("13.3", f"{design.name}: staleness mean", mean, o.staleness_mean),
                    Figure("13.3", f"{design.name}: staleness max", top, o.staleness_max),
                    Figure("13.3", f"{design.name}: trained episode mean (s)", trained, o.trained_duration)]
    small = Pipeline(slots=8, batch_size=8, steps=4)
    figures += [Figure("13.3", "timeline, 8 slots, 4 steps: synchronous seconds", 1130,
                       simulate(pool, small, SYNCHRONOUS).seconds),
                Figure("13.3", "timeline, 8 slots, 4 steps: async eta=1, partial seconds", 493,
                       simulate(pool, small, asynchronous(1, partial=True)).seconds)]
    return figures


def _sync_figures(pool: list[float]) -> list[Figure]:
    """Section 13.7's sync-cost table and the throughput each design loses from 1 s to 60 s."""
    printed = {1.0: (459, 2261), 10.0: (451, 2077), 60.0: (410, 1432)}
    designs = (SYNCHRONOUS, asynchronous(2, partial=True))
    runs: dict[float, list[Outcome]] = {s: [simulate(pool, Pipeline(sync_s=s), d) for d in designs] for s in printed}
    figures = [Figure("13.7", f"sync {s:.0f} s: {d.name} episodes/hour", printed[s][i], runs[s][i].throughput)
               for s in printed for i, d in enumerate(designs)]
    for i, (design, lost) in enumerate(zip(designs, (0.11, 0.37))):
        cost = 1 - runs[60.0][i].throughput / runs[1.0][i].throughput
        figures.append(Figure("13.7", f"sync 1 s -> 60 s: {design.name} throughput lost", lost, cost))
    return figures


def _tail_figures(durations: torch.Tensor) -> list[Figure]:
    pool = summarise(durations)
    figures = [Figure("13.2", "pool mean (s)", 96, pool.mean), Figure("13.2", "pool median (s)", 68, pool.median),
               Figure("13.2", "pool p90 (s)", 215, pool.p90), Figure("13.2", "pool p99 (s)", 430, pool.p99),
               Figure("13.2", "pool max (s)", 624, pool.max)]
    figures += [Figure("13.2", f"slowest of B = {b} / mean", ratio, straggler_ratio(durations, b))
                for b, ratio in ((8, 2.6), (64, 4.3), (512, 5.4))]
    cap = durations.quantile(0.95).item()
    capped = simulate(durations.clamp(max=cap).tolist(), Pipeline(), SYNCHRONOUS)
    figures += [Figure("13.7", "timeout at p95 (s)", 279, cap),
                Figure("13.7", "synchronous, timeout at p95: episodes/hour", 661, capped.throughput),
                Figure("13.7", "synchronous, timeout at p95: slot utilisation", 0.27, capped.utilisation)]
    bias = failure_bias(durations)
    figures += [Figure("13.7", "constant hazard: episodes failing", 0.045, bias.failing),
                Figure("13.7", "constant hazard: longest tenth failing", 0.136, bias.failing_longest_tenth),
                Figure("13.7", "mean duration, all (s)", 96, bias.mean_all),
                Figure("13.7", "mean duration, survivors (s)", 92, bias.mean_survivors)]
    return figures


def reproduce() -> list[Figure]:
    """Every figure of sections 13.2, 13.3 and 13.7 that the chapter defines by its model and
    simulator, recomputed."""
    durations = chapter_durations()
    pool = durations.tolist()
    return _tail_figures(durations) + _pipeline_figures(pool) + _sync_figures(pool)


def _number(value: float) -> str:
    if value == int(value) and abs(value) >= 1:
        return f"{value:,.0f}"
    return f"{value:,.3g}" if abs(value) < 10 else f"{value:,.1f}"


def render(figures: list[Figure]) -> str:
    """The figures as a text table: section, figure, chapter, reproduced, relative error."""
    width = max(len(f.what) for f in figures)
    lines = [f"{'sec.':<5} {'figure':<{width}} | {'chapter':>8} | {'here':>8} | error"]
    for f in figures:
        lines.append(f"{f.section:<5} {f.what:<{width}} | {_number(f.chapter):>8} | {_number(f.reproduced):>8} | "
                     f"{f.error:6.1%}")
    worst = max(figures, key=lambda f: f.error)
    lines.append(f"{len(figures)} figures; largest error {worst.error:.1%} ({worst.what})")
    return "\n".join(lines)


def design_table() -> str:
    """Every design ``rlwatch whatif`` compares, on the chapter's pool and pipeline, as text."""
    from .simulate import DESIGNS, compare

    lines = [f"{'design':<22} | episodes/hour | slot util | staleness mean, max | trained episode mean (s)"]
    for o in compare(chapter_durations().tolist(), Pipeline(), DESIGNS):
        lines.append(f"{o.design.name:<22} | {o.throughput:13,.0f} | {o.utilisation:9.2f} | "
                     f"{o.staleness_mean:8.2f}, {o.staleness_max:2d}      | {o.trained_duration:6.1f}")
    return "\n".join(lines)
