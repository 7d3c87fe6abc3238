"""How early could any simple threshold page a corpus collapse without paging a healthy run?

``python -m evaluation.realruns.headroom [--split all|tuning|test] [--min-healthy N] [--json FILE]``

An upper bound, not a detector: for every logged step of every collapsed run, each recognised signal's
5-row median (its *level*) and that level over the median of the run's first 10 values (its *rise*), up
and down, are set against the same statistics at every step of every healthy run of the corpus. A rule
"page when statistic A passes a" (one statistic) or "when A passes a and B passes b" (two) pages the
collapse at a step and no healthy run at any step exactly when no healthy step is at least as far out on
A (and on B). The earliest such step before the authors' collapse step is the most lead any rule of
that family could have had on the run, with thresholds chosen in hindsight on the whole corpus. A
statistic (or pair) that fewer than ``--min-healthy`` healthy runs log is not judged: there is no
evidence that healthy runs stay below it.

As the alerts do, a row whose groups all had equal rewards (zero-std ratio at 1: no learning signal)
contributes no batch statistic (entropy, gradient norm, policy KL, response length).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from rlwatch.alerts.domains.dynamics import BATCH_SIGNALS, SMOOTH

from .corpus import CorpusRun, load_run, runs

#: The run's first values whose median a rise is measured against.
BASELINE = 10
#: Signals of the trained batch, left out on a row with no learning signal: the dynamics alerts' own, and two
#: more of the batch that no alert reads.
BATCH = {*BATCH_SIGNALS, "response_length_max", "clip_fraction"}
#: A schedule, not a dynamic of the run.
SKIPPED = {"learning_rate"}

Point = dict[str, float]


def run_points(entry: CorpusRun) -> list[tuple[int, Point]]:
    """``[(step, {statistic: value})]`` of one run, a statistic named ``<signal> level|rise up|down``
    (a down statistic negated, so that "further out" is always "larger")."""
    run = load_run(entry)
    signal_of = {k: s for k, s in run.recognised().items() if s not in SKIPPED}
    zero_std = {k for k, s in signal_of.items() if s == "zero_std_ratio"}
    values: dict[str, list[float]] = {}
    out: list[tuple[int, Point]] = []
    keys: dict[str, list[str]] = {}
    for key, signal in signal_of.items():
        keys.setdefault(signal, []).append(key)
    for step, row in zip(run.steps, run.rows):
        dead = any(row.get(k, 0.0) >= 1.0 for k in zero_std)
        point: Point = {}
        for signal, candidates in keys.items():
            value = next((row[k] for k in candidates if k in row), None)     # the first key logged wins
            if value is None or not math.isfinite(value) or (dead and signal in BATCH):
                continue
            series = values.setdefault(signal, [])
            series.append(value)
            point.update(_statistics(signal, series))
        out.append((step, point))
    return out


def _statistics(signal: str, series: list[float]) -> Point:
    if len(series) < SMOOTH:
        return {}
    level = statistics.median(series[-SMOOTH:])
    out = {f"{signal} level up": level, f"{signal} level down": -level}
    if len(series) > BASELINE:
        base = statistics.median(series[:BASELINE])
        if base > 0:
            out[f"{signal} rise up"] = level / base
            out[f"{signal} rise down"] = -level / base
    return out


class Envelope:
    """The healthy runs' points: for one statistic its largest value, for a pair its Pareto front."""

    def __init__(self, healthy: dict[str, list[tuple[int, Point]]], min_healthy: int) -> None:
        self.min_healthy = min_healthy
        self.points = [p for pts in healthy.values() for _, p in pts]
        self.runs_logging: dict[str, set[str]] = {}
        for run_id, pts in healthy.items():
            for _, p in pts:
                for stat in p:
                    self.runs_logging.setdefault(stat, set()).add(run_id)
        self.top = {s: max(p[s] for p in self.points if s in p) for s in self.runs_logging}
        self.fronts: dict[tuple[str, str], tuple[list[float], list[float]]] = {}

    def judged(self, *stats: str) -> bool:
        sets = [self.runs_logging.get(s, set()) for s in stats]
        return len(set.intersection(*sets)) >= self.min_healthy

    def _front(self, a: str, b: str) -> tuple[list[float], list[float]]:
        if (a, b) not in self.fronts:
            pairs = sorted(((p[a], p[b]) for p in self.points if a in p and b in p), reverse=True)
            xs, best, top = [], [], -math.inf          # xs descending; best[i]: the largest b with a >= xs[i]
            for x, y in pairs:
                top = max(top, y)
                xs.append(-x)
                best.append(top)
            self.fronts[(a, b)] = (xs, best)
        return self.fronts[(a, b)]

    def beyond(self, point: Point, a: str, b: str | None = None) -> bool:
        """No healthy point at least as far out on ``a`` (and ``b``)."""
        if b is None:
            return point[a] > self.top[a]
        xs, best = self._front(a, b)
        i = bisect.bisect_right(xs, -point[a])       # healthy points with a >= point[a]
        return i == 0 or best[i - 1] < point[b]


@dataclass
class Headroom:
    """One run against the envelope: the first step (before the collapse, on a collapsed run; any step, on
    a healthy run) that one statistic, or two of different signals, put beyond it."""

    id: str
    split: str
    outcome: str
    collapse_step: int | None
    one: tuple[int, str] | None           # (step, statistic)
    two: tuple[int, str, str] | None      # (step, statistic, statistic)

    def lead(self, found: tuple | None) -> int | None:
        return None if found is None or self.collapse_step is None else self.collapse_step - found[0]


def _signal(stat: str) -> str:
    return stat.split(" ")[0]


def _kind(stat: str) -> str:
    return stat.split(" ")[1]


def headroom(entry: CorpusRun, points: list[tuple[int, Point]], envelope: Envelope,
             kinds: tuple[str, ...] = ("rise",)) -> Headroom:
    """The first step of ``entry`` (before its authors' collapse step, if any) beyond ``envelope``."""
    one = two = None
    for step, point in points:
        if entry.collapse_step is not None and step >= entry.collapse_step:
            break
        stats = sorted(s for s in point if _kind(s) in kinds and s in envelope.top and envelope.judged(s))
        if one is None:
            one = next(((step, s) for s in stats if envelope.beyond(point, s)), None)
        if two is None:
            two = next(((step, a, b) for a, b in itertools.combinations(stats, 2)
                        if _signal(a) != _signal(b) and envelope.judged(a, b) and envelope.beyond(point, a, b)),
                       one and (one[0], one[1], "-"))
        if one is not None and two is not None:
            break
    return Headroom(entry.id, entry.split, entry.outcome, entry.collapse_step, one, two)


def measure(envelope_split: str = "all", min_healthy: int = 3,
            kinds: tuple[str, ...] = ("rise",)) -> list[Headroom]:
    """The envelope of the healthy runs of ``envelope_split`` (``all``: hindsight on the whole corpus), and
    every run with a collapse step outside it, and (``tuning``) every test run, against it: ``kinds`` the
    statistics (``rise``: run-relative, as the alerts judge; ``level``: absolute)."""
    every = runs("all")
    points = {e.id: run_points(e) for e in every}
    envelope = Envelope({e.id: points[e.id] for e in every if e.outcome == "healthy"
                         and envelope_split in ("all", e.split)}, min_healthy)
    judged = [e for e in every if (e.outcome == "collapsed" and e.collapse_step is not None)
              or (e.outcome == "healthy" and envelope_split not in ("all", e.split))]
    if envelope_split != "all":
        judged = [e for e in judged if e.split != envelope_split]
    return [headroom(e, points[e.id], envelope, kinds) for e in judged]


def figures(found: list[Headroom], pick: str) -> tuple[int, int, float | None, int, int]:
    """(collapses beyond the envelope before the authors' step, collapses, their median lead in steps,
    healthy runs beyond it, healthy runs judged) on ``pick`` (``one``: one statistic; ``two``: one or two)."""
    collapses = [h for h in found if h.collapse_step is not None]
    healthy = [h for h in found if h.outcome == "healthy"]
    leads = [x for x in (h.lead(getattr(h, pick)) for h in collapses) if x is not None]
    return (len(leads), len(collapses), statistics.median(leads) if leads else None,
            sum(getattr(h, pick) is not None for h in healthy), len(healthy))


def doc_rows() -> list[str]:
    """The headroom table of docs/real-runs.md: run-relative statistics, hindsight on every healthy run and
    the healthy tuning runs judging the test runs."""
    rows = ["| thresholds set on | statistics | collapses beyond before the authors' step | median lead | "
            "healthy runs beyond |", "|---|---|---|---|---|"]
    for envelope in ("all", "tuning"):
        found = measure(envelope)
        where = "every healthy run (hindsight)" if envelope == "all" else "the healthy tuning runs"
        for pick, label in (("one", "one"), ("two", "one, or two of different signals")):
            beyond, n, lead, paged, healthy = figures(found, pick)
            rows.append(f"| {where} | {label} | {beyond} of {n} | {'-' if lead is None else f'{lead:g} steps'} | "
                        + (f"{paged} of {healthy} test runs |" if healthy else "none, by construction |"))
    return rows


def _say(h: Headroom, found: tuple | None) -> str:
    if found is None:
        return "none"
    lead = f" (lead {h.lead(found)})" if h.collapse_step is not None else ""
    return f"step {found[0]}{lead}: " + " & ".join(x for x in found[1:] if x != "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.realruns.headroom", description=__doc__.splitlines()[0])
    parser.add_argument("--envelope", choices=("all", "tuning"), default="all",
                        help="the healthy runs that set the thresholds: all (hindsight), or the tuning runs', "
                             "the test runs judged against them")
    parser.add_argument("--min-healthy", type=int, default=3, help="healthy runs that must log a statistic")
    parser.add_argument("--levels", action="store_true",
                        help="also absolute levels (a level the few healthy runs never reached may be a configuration, "
                             "not a precursor)")
    parser.add_argument("--json", help="also write the per-run results to this file")
    args = parser.parse_args(argv)
    found = measure(args.envelope, args.min_healthy, ("rise", "level") if args.levels else ("rise",))
    for h in found:
        where = f"collapse@{h.collapse_step}" if h.collapse_step is not None else h.outcome
        print(f"{h.id:<40} {h.split:<7} {where:<14} one statistic: {_say(h, h.one)}")
        print(f"{'':<63} one or two: {_say(h, h.two)}")
    for pick, label in (("one", "one statistic"), ("two", "one or two statistics")):
        beyond, n, lead, paged, healthy = figures(found, pick)
        print(f"{label}: {beyond}/{n} collapses beyond the healthy envelope before the authors' step"
              + (f", median lead {lead:g} steps" if lead is not None else "")
              + (f"; healthy runs beyond it: {paged}/{healthy}" if healthy else ""))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(h) for h in found], indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
