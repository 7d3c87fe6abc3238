"""Paired per-step overhead for work that spills into the following step.

rlwatch hands part of a step's work to its own thread (the TRL hook's signals) or process (the
reward-hack detectors), which run while the trainer goes on with the next step; so the cost of
watching step k lands in step k and in step k + 1. Cycles of four steps measure it without giving
that spill to the wrong arm: step k is watched, step k + 1 carries the spill, and steps k + 2 and
k + 3 are neither (the baseline). Adjacent steps share the model, the batch shapes and the load of a
shared machine, so its drift cancels within a cycle, which separate runs cannot offer.

A cycle's estimate of the cost of watching, as a fraction of a step, is
``(t[k] + t[k+1] - t[k+2] - t[k+3]) / ((t[k+2] + t[k+3]) / 2)``: with every step watched, each step
would carry one step's worth of that extra time. The summary is the median over cycles with a
bootstrap 95% interval.
"""

from __future__ import annotations

import random
import statistics
from typing import Sequence

PERIOD = 4


def watched(index: int) -> bool:
    """Whether step ``index`` (0-based, counted from the start of a run) is a watched step."""
    return index % PERIOD == 0


def cycle_overheads(times: Sequence[float], first_index: int = 0, clean: Sequence[bool] | None = None) -> list[float]:
    """Per-cycle overhead fractions from consecutive step times of one run, ``times[i]`` being step
    ``first_index + i``. ``clean[i]`` False drops the cycle whose baseline starts at step i (the
    spill of the watched step had not finished by then)."""
    out = []
    for k in range(len(times) - PERIOD + 1):
        if not watched(first_index + k):
            continue
        if clean is not None and not clean[k + 2]:
            continue
        base = times[k + 2] + times[k + 3]
        out.append((times[k] + times[k + 1] - base) / (base / 2))
    return out


def summary(overheads: Sequence[float], resamples: int = 4000) -> tuple[float, float, float]:
    """(median, low, high): the median overhead fraction and its bootstrap 95% interval."""
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(overheads, k=len(overheads))) for _ in range(resamples))
    return statistics.median(overheads), boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]


def describe(overheads: Sequence[float]) -> str:
    median, low, high = summary(overheads)
    return (f"{median * 100:+.2f}% of a step (bootstrap 95% interval {low * 100:+.2f}% .. {high * 100:+.2f}%, "
            f"{len(overheads)} cycles)")
