"""Long runs in bounded memory and time: at most :data:`MAX_POINTS` points per series.

A run of at most :data:`MAX_POINTS` steps is analysed step by step, every signal kept. A longer run
is cut into buckets of ``width`` consecutive steps (``width`` a 1-2-5 number, so two runs of like
length share their buckets and stay aligned by step): each bucket is one point at its first step,
holding the mean of each signal over the bucket's steps (the maximum for ``*_max`` signals), and only
the signals the post-mortem reads are kept. A store is read as a stream of rows and reduced as it
goes (:class:`Buckets`), decoding at most :data:`MAX_ROWS` step rows: past that, every
``stride``-th step (steps whose number is a multiple of it), so a bucket's point is the mean of the
steps of it that were decoded. Other sources are reduced once loaded (:func:`downsample_run`).
Changes and the collapse of such a run are dated to the bucket they fall in.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

from ..core.values import Values

#: Points per series the analysis and the plots get at most.
MAX_POINTS = 20_000
#: Step rows of a store decoded at most: a longer run's buckets average every ``stride``-th step.
MAX_ROWS = 100_000


def row_stride(rows: int, budget: int = MAX_ROWS) -> int:
    """Decode every ``row_stride``-th step of a run of ``rows`` step rows (1: every step)."""
    return max(1, math.ceil(rows / budget))


def bucket_width(first: int, last: int, points: int = MAX_POINTS) -> int:
    """The smallest 1-2-5 number of steps per bucket that leaves at most ``points`` buckets between
    ``first`` and ``last`` (1 where the run is that short)."""
    span = last - first + 1
    if span <= points:
        return 1
    need = math.ceil(span / points)
    decade = 10 ** max(0, len(str(need)) - 1)
    for factor in (1, 2, 5, 10):
        if factor * decade >= need:
            # aligned buckets start at multiples of the width: one more bucket at most
            width = factor * decade
            if last // width - first // width + 1 <= points:
                return width
    return 20 * decade


def _peak(name: str) -> bool:
    return name.endswith("_max")


class Buckets:
    """Step values folded into buckets of ``width`` steps (``add`` in step order; ``points`` yields
    ``(first step of the bucket, values)``). ``width`` 1 keeps every step as it came."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._key: int | None = None
        self._sums: dict[str, dict[tuple[str, ...], list[float]]] = {}
        self.points: list[tuple[int, Values]] = []

    def add(self, step: int, values: Values) -> None:
        if self.width == 1:
            self.points.append((step, values))
            return
        key = step - step % self.width
        if key != self._key:
            self._close()
            self._key = key
        sums = self._sums
        for name, family in values.items():
            into = sums.get(name)
            if into is None:
                into = sums[name] = {}
            peak = _peak(name)
            for labels, value in family.items():
                acc = into.get(labels)
                if acc is None:
                    into[labels] = [value, 1.0]
                elif peak:
                    acc[0] = max(acc[0], value)
                else:
                    acc[0] += value
                    acc[1] += 1.0
        return

    def _close(self) -> None:
        if self._key is None or not self._sums:
            return
        self.points.append((self._key, {name: {labels: (acc[0] if _peak(name) else acc[0] / acc[1])
                                               for labels, acc in family.items()}
                                        for name, family in self._sums.items()}))
        self._sums = {}

    def finish(self) -> list[tuple[int, Values]]:
        """The points, the last bucket closed."""
        self._close()
        self._key = None
        return self.points


def downsample(steps: list[tuple[int, Values]], signals: Iterable[str] | None = None) -> list[tuple[int, Values]]:
    """``steps`` (step order) reduced to :data:`MAX_POINTS` buckets, keeping ``signals`` only (all
    when None); unchanged where there are that few steps."""
    if len(steps) <= MAX_POINTS:
        return steps
    keep = None if signals is None else set(signals)
    buckets = Buckets(bucket_width(steps[0][0], steps[-1][0]))
    for step, values in steps:
        buckets.add(step, values if keep is None else {k: v for k, v in values.items() if k in keep})
    return buckets.finish()


def downsample_scalars(points: Iterator[tuple[int, float]] | list[tuple[int, float]], width: int
                       ) -> list[tuple[int, float]]:
    """One framework scalar's ``(step, value)`` points (step order) as bucket means of ``width`` steps."""
    if width == 1:
        return list(points)
    out: list[tuple[int, float]] = []
    key, total, count = None, 0.0, 0
    for step, value in points:
        at = step - step % width
        if at != key:
            if count:
                out.append((key, total / count))
            key, total, count = at, 0.0, 0
        total += value
        count += 1
    if count:
        out.append((key, total / count))
    return out


def downsample_run(data: object, signals: Iterable[str] | None = None) -> None:
    """Reduce a loaded run (a :class:`~rlwatch.postmortem.sources.RunData`) in place: its steps to
    :func:`downsample`, each framework scalar longer than :data:`MAX_POINTS` to bucket means."""
    steps = data.steps
    if len(steps) > MAX_POINTS:
        data.steps = downsample(steps, signals)
    for name, points in list(data.scalars.items()):
        if len(points) > MAX_POINTS:
            points = sorted(points)
            data.scalars[name] = downsample_scalars(points, bucket_width(points[0][0], points[-1][0]))
