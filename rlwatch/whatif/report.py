"""``rlwatch whatif RUN``: the run's measured durations, training and sync seconds fed to the
pipeline simulation for every design, next to what the run measured, with a recommendation that
weighs each design's throughput against the k3 its staleness would cost at the run's measured
mismatch by version lag."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from ..alerts.params import PARAMS
from .measured import Measured
from .simulate import DESIGNS, SYNCHRONOUS, Design, Outcome, Pipeline, asynchronous, episodes_needed, simulate

#: A design within this share of the best eligible throughput counts as as good (the least stale wins).
THROUGHPUT_TIE = 0.05
#: Without a measured cost of lag, the largest bound recommended (the chapter's default: 1 or 2).
DEFAULT_MAX_ETA = 2
#: Steps simulated: the run's own count, kept within these.
MIN_STEPS, MAX_STEPS = 20, 200
#: The largest staleness bound a run's own design is simulated with (named from its measured lag).
MAX_OWN_ETA = 64
#: Episodes shorter than this on average (seconds) are a toy's: a language model's episode generates
#: at least tens of tokens, which takes longer than 0.1 s on any engine.
PLAUSIBLE_EPISODE_S = 0.1
#: The most episodes one design may start in a simulation (about a second of simulation per 10^6 episodes
#: on one core; every design is simulated): larger requests are refused, not allocated.
MAX_EPISODES = 2_000_000


class NoDurations(ValueError):
    """The run records no episode durations: nothing to simulate."""


class TooLarge(ValueError):
    """A simulation that would start more than :data:`MAX_EPISODES` episodes in one design."""


@dataclass
class WhatIf:
    """Every design simulated on a run's measurements, and what to do about it."""

    measured: Measured
    pipeline: Pipeline
    outcomes: list[Outcome]
    own: Design | None
    k3_bound: float
    own_basis: str = ""                   # what names the run's own design (its bound, its measured lag)
    recommended: Outcome | None = None
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def k3(self, lag: float) -> tuple[float, bool] | None:
        """Predicted k3 at ``lag`` (and whether extrapolated), None without a measured mismatch by lag."""
        return self.measured.lag_cost.at(lag)


def _own_design(m: Measured) -> tuple[Design | None, str]:
    """The run's own design and what names it. The measured lag wins over the configured bound:
    a run whose mean per-token lag exceeds its staleness bound (a bound not enforced) is named
    ``async eta=ceil(mean lag)``, the design whose simulation gives that lag; a run whose lag never
    left 0 is synchronous; partial rollouts when any sequence spanned versions."""
    partial = bool(m.partial)
    lag = "" if m.staleness_mean is None else f"measured lag mean {m.staleness_mean:.2f}" + (
        f", max {m.staleness_max:g}" if m.staleness_max is not None else "")
    bound = round(m.staleness_bound) if m.staleness_bound is not None and m.staleness_bound >= 0 else None
    if m.staleness_max == 0:
        return SYNCHRONOUS, "its " + (lag or "measured lag 0")
    if m.staleness_mean is not None and (bound is None or m.staleness_mean > bound):
        eta = math.ceil(m.staleness_mean)
        held = f"; its staleness bound {bound} does not hold" if bound is not None else ""
        if eta > MAX_OWN_ETA:
            return None, f"{lag}, beyond any design simulated{held}"
        return (SYNCHRONOUS if eta == 0 else asynchronous(eta, partial)), f"from its {lag}{held}"
    if bound is not None:
        return (SYNCHRONOUS if bound == 0 else asynchronous(bound, partial)), \
            f"its staleness bound {bound}" + (f", {lag}" if lag else "")
    return None, "no staleness bound and no measured lag"


def _toy_note(m: Measured) -> list[str]:
    """A note when the run's episodes are shorter than any language model's (a toy's durations)."""
    mean = statistics.fmean(m.launched_durations)
    if mean >= PLAUSIBLE_EPISODE_S:
        return []
    return [f"episodes last {mean * 1000:.3g} ms on average, below {PLAUSIBLE_EPISODE_S:g} s, shorter than any "
            "language model's episode: these are a toy's durations, and the episodes/hour below are the toy's"]


def _inputs(m: Measured, slots: int | None, batch_size: int | None, train_s: float | None,
            sync_s: float | None, steps: int | None) -> tuple[Pipeline, list[str]]:
    notes = []
    size = batch_size or m.batch_size
    if size is None:
        size = 64
        notes.append("the run records no batch size (sequences): 64 episodes per step assumed (--batch-size)")
    timed = {}
    for name, given, measured, key in (("train_s", train_s, m.train_s, 'phase_seconds{phase="training"}'),
                                       ("sync_s", sync_s, m.sync_s, 'phase_seconds{phase="sync"}')):
        timed[name] = given if given is not None else measured
        if timed[name] is None:
            timed[name] = 0.0
            notes.append(f"the run records no {key}: 0 s assumed (--{name.replace('_', '-')})")
    if slots is None:
        slots = size
        notes.append(f"generation slots: not recorded by the run; {size} assumed, one per episode of a step (--slots)")
    run_steps = steps or min(max(m.steps, MIN_STEPS), MAX_STEPS)
    return Pipeline(slots, size, timed["train_s"], timed["sync_s"], run_steps), notes


def build(m: Measured, *, slots: int | None = None, batch_size: int | None = None, train_s: float | None = None,
          sync_s: float | None = None, steps: int | None = None, seed: int = 0,
          k3_bound: float | None = None, designs: tuple[Design, ...] = DESIGNS) -> WhatIf:
    """Simulate ``designs`` with episodes drawn (with replacement, torch seed ``seed``) from the run's
    measured durations; explicit arguments replace what the run measured."""
    if not m.launched_durations and m.env is not None and m.envs:
        raise NoDurations(f"run {m.run!r} records no episode durations for env {m.env!r}; environments with "
                          f"durations: {', '.join(m.envs)}")
    if not m.launched_durations:
        raise NoDurations(f"run {m.run!r} records no episode durations (episode_duration_sample_seconds): pass "
                          "durations to Watch.observe (docs/rollout-system.md); `rlwatch whatif --chapter` runs "
                          "the simulation on the duration model of chapter 13 of the Agent RL tutorial")
    pipeline, notes = _inputs(m, slots, batch_size, train_s, sync_s, steps)
    pool = torch.tensor(m.launched_durations, dtype=torch.float64)
    own, basis = _own_design(m)
    notes = _toy_note(m) + notes
    runs = list(designs) + ([own] if own is not None and own not in designs else [])
    needed = max(episodes_needed(pipeline, d) for d in runs)
    if needed > MAX_EPISODES:
        raise TooLarge(f"{pipeline.steps:,} steps of {pipeline.batch_size:,} episodes would simulate {needed:,} "
                       f"episodes per design, more than {MAX_EPISODES:,}: lower --steps or --batch-size")
    drawn = pool[torch.randint(len(pool), (needed,), generator=torch.Generator().manual_seed(seed))].tolist()
    outcomes = [simulate(drawn, pipeline, d) for d in runs]
    bound = k3_bound if k3_bound is not None else m.k3_bound if m.k3_bound is not None else \
        PARAMS["kl_k3_max"].default
    result = WhatIf(m, pipeline, outcomes, own, bound, own_basis=basis, notes=notes)
    _recommend(result)
    return result


def _k3_text(result: WhatIf, lag: float) -> str:
    k3 = result.k3(lag)
    if k3 is None:
        return "unknown"
    return f"{k3[0]:.3g}{' (extrapolated)' if k3[1] else ''}"


def _lag_line(result: WhatIf) -> str:
    cost = result.measured.lag_cost
    if not cost.points:
        return ("The run records no mismatch by version lag (mismatch_kl_k3_by_lag: needs sampler log-probs and "
                "per-token versions), so what staleness costs it is unknown.")
    levels = ", ".join(f"lag {lag:g}: {k3:.3g} ({n:,.0f} tokens)" for lag, (k3, n) in sorted(cost.points.items()))
    slope = cost.slope
    per = (f"each extra version of lag costs {slope:+.3g} in k3 (least squares over {len(cost.points)} lags)"
           if slope is not None else "one lag only, so the cost per version is unknown")
    return f"Mismatch k3 by version lag, {levels}: {per}; the k3 alert bound (kl_k3_max) is {result.k3_bound:g}."


def _eligible(result: WhatIf) -> tuple[list[Outcome], str]:
    cost = result.measured.lag_cost
    if cost.slope is None:
        limit = DEFAULT_MAX_ETA
        return ([o for o in result.outcomes if o.design.eta <= limit],
                f"without a measured cost per version, bounds above {limit} are left out (the chapter's default: "
                f"eta in {{1, 2}} with TIS from the start)")
    fits = [o for o in result.outcomes if (k3 := result.k3(o.staleness_mean)) is not None and k3[0] <= result.k3_bound]
    return fits, f"designs whose predicted k3 at their mean staleness stays within {result.k3_bound:g}"


def _recommend(result: WhatIf) -> None:
    advice = [_lag_line(result)]
    eligible, rule = _eligible(result)
    if not eligible:
        advice.append(f"No design keeps k3 within the bound ({rule}): the run's mismatch at lag 0 already "
                      "exceeds it; fix the sampler/trainer mismatch before choosing a staleness bound.")
        result.advice = advice
        return
    best = max(o.throughput for o in eligible)
    close = [o for o in eligible if o.throughput >= (1 - THROUGHPUT_TIE) * best]
    pick = min(close, key=lambda o: (o.design.eta, o.staleness_max, -o.throughput))
    result.recommended = pick
    d, m = pick.design, result.measured
    gain = f", {pick.throughput / m.throughput:.1f}x the run's measured {m.throughput:,.0f}" if m.throughput else ""
    advice.append(f"Recommended: {d.name}: {pick.throughput:,.0f} episodes/hour{gain}, slots busy "
                  f"{pick.utilisation:.0%}, staleness mean {pick.staleness_mean:.2f}, max {pick.staleness_max}; "
                  f"predicted k3 {_k3_text(result, pick.staleness_mean)} at its mean lag ({rule}; the least "
                  f"stale within {THROUGHPUT_TIE:.0%} of the best such throughput).")
    if pick.staleness_max > d.eta:
        advice.append(f"Its count-based throttle lets the oldest trained episodes reach lag {pick.staleness_max} > "
                      f"eta = {d.eta} (predicted k3 there {_k3_text(result, pick.staleness_max)}): enforce the bound "
                      "at consumption too (drop or correct episodes older than eta) and log the staleness histogram.")
    if d.partial and d.eta > 0:
        advice.append("Partial rollouts need an engine that keeps in-flight episodes across a weight sync (they "
                      "finish under the new weights); otherwise the draining rows apply.")
    faster = [o for o in result.outcomes if o.throughput > pick.throughput * (1 + THROUGHPUT_TIE) and o not in eligible]
    if faster:
        top = max(faster, key=lambda o: o.throughput)
        advice.append(f"Faster but left out: {top.design.name} ({top.throughput:,.0f} episodes/hour, predicted k3 "
                      f"{_k3_text(result, top.staleness_mean)} at mean lag {top.staleness_mean:.2f}): only with "
                      "a looser k3 bound, i.e. TIS or MIS correction of the stale episodes.")
    _calibration(result, advice)
    result.advice = advice


def _calibration(result: WhatIf, advice: list[str]) -> None:
    own, m = result.own, result.measured
    if own is None or not m.throughput:
        return
    sim = next(o for o in result.outcomes if o.design == own)
    advice.append(f"Check: the run's own design ({own.name}) simulates {sim.throughput:,.0f} episodes/hour "
                  f"against {m.throughput:,.0f} measured ({sim.throughput / m.throughput:.2f}x); far from 1, the "
                  "slots or phases assumed differ from the run's (--slots, --train-s, --sync-s).")
    if m.unphased_s is not None and m.interval_s and m.unphased_s > 0.1 * m.interval_s:
        advice.append(f"The run's steps last {m.interval_s:.3g} s (median), {m.unphased_s:.3g} s of it outside "
                      "every recorded phase (rewards, evaluation, logging): the simulation leaves that time out.")


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def render(result: WhatIf) -> str:
    """The table (the run's measured row first) and the recommendation, as text."""
    m, p = result.measured, result.pipeline
    trained = statistics.fmean(m.trained_durations) if m.trained_durations else None
    lines = [f"rlwatch whatif: run {m.run!r} ({m.source}), {len(m.launched_durations):,} episode durations "
             f"(mean {statistics.fmean(m.launched_durations):.3g} s, max {max(m.launched_durations):.3g} s)",
             f"simulated: {p.slots} slots, {p.batch_size} episodes per step, {p.train_s:.3g} s training, "
             f"{p.sync_s:.3g} s sync, {p.steps} steps; the run's own design: "
             f"{result.own.name if result.own else 'unknown'} ({result.own_basis})"]
    lines += [f"note: {n}" for n in result.notes]
    head = (f"{'design':<24} | episodes/hour | slots busy | staleness mean, max | trained episode mean (s) | "
            f"k3 at mean lag")
    lines += ["", head, "-" * len(head)]
    util = m.utilisation(p.slots)
    lines.append(f"{'the run, measured':<24} | {_cell(m.throughput, '13,.0f')} | {_cell(util, '10.2f')} | "
                 f"{_cell(m.staleness_mean, '8.2f')}, {_cell(m.staleness_max, '2.0f')}      | "
                 f"{_cell(trained, '24.3g')} | {_cell(m.lag_cost.overall, '.3g')}")
    for o in result.outcomes:
        marker = " <" if o is result.recommended else ""
        k3 = result.k3(o.staleness_mean)
        lines.append(f"{o.design.name:<24} | {o.throughput:13,.0f} | {o.utilisation:10.2f} | "
                     f"{o.staleness_mean:8.2f}, {o.staleness_max:2d}      | {o.trained_duration:24.3g} | "
                     f"{_cell(k3[0] if k3 else None, '.3g')}{'*' if k3 and k3[1] else ''}{marker}")
    lines.append("(the run's staleness: per-token version lag; its slots busy: episode-seconds over slots x wall "
                 "time, an estimate; its k3: token-weighted over all lags; * extrapolated; < recommended)")
    return "\n".join(lines + [""] + result.advice)


def as_json(result: WhatIf) -> dict[str, Any]:
    """The report as plain data."""
    from .measured import describe

    def row(o: Outcome) -> dict[str, Any]:
        k3 = result.k3(o.staleness_mean)
        return {"design": o.design.name, "eta": o.design.eta, "partial": o.design.partial,
                "episodes_per_hour": o.throughput, "slot_utilisation": o.utilisation,
                "staleness_mean": o.staleness_mean, "staleness_max": o.staleness_max,
                "trained_duration_mean_s": o.trained_duration, "launched_duration_mean_s": o.launched_duration,
                "k3_at_mean_lag": k3[0] if k3 else None}

    p = result.pipeline
    return {"measured": describe(result.measured), "pipeline": p.__dict__, "notes": result.notes,
            "own_design": result.own.name if result.own else None, "own_design_basis": result.own_basis,
            "k3_bound": result.k3_bound,
            "designs": [row(o) for o in result.outcomes],
            "recommended": result.recommended.design.name if result.recommended else None, "advice": result.advice}
