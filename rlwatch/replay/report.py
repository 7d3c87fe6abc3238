"""``rlwatch replay``'s text: what would have fired and when, against the run's own reward curve."""

from __future__ import annotations

from .run import ReplayResult, treatment

RANGES = 16          # rows of the reward table (step ranges of equal length in logged rows)


def _safe(value: object) -> str:
    from ..postmortem.report import safe

    return safe(value, 200)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _quality(result: ReplayResult) -> str | None:
    """The logged key the post-mortem dated the peak and the collapse on, when it is not the table's
    reward (a held-out score evaluated often enough); None when it is the reward."""
    run, quality = result.run, result.postmortem.get("quality_signal")
    if quality in (None, "reward_mean", run.reward_key):
        return None
    if quality == "heldout_score":
        keys = [k for k, signal in run.recognised().items() if signal == "heldout_score"]
        return keys[0] if keys else "the held-out score"
    return quality


def _header(result: ReplayResult) -> list[str]:
    run = result.run
    lines = [f"rlwatch replay: {_safe(run.source)} ({run.fmt}): {len(run.steps)} logged rows, steps "
             f"{run.steps[0]}..{run.steps[-1]}, logged every {run.log_every} step{'s' if run.log_every != 1 else ''}",
             "  " + treatment(run.log_every)]
    if run.reward_key is None:
        lines.append("  reward: no recognised reward key (name it with --reward KEY); the collapse cannot be dated")
    else:
        lines.append(f"  reward: {_safe(run.reward_key)}")
    quality = _quality(result)
    if quality is not None:
        lines.append(f"  quality: {_safe(quality)}: the peak and the collapse are dated on it (the table shows the "
                     "training reward)")
    recognised = run.recognised()
    shown = ", ".join(f"{_safe(k)} as {signal}" for k, signal in recognised.items())
    lines.append(f"  read as rlwatch signals: {shown or 'none'}; {len(run.keys) - len(recognised)} other keys kept "
                 "as framework scalars")
    kept = run.kept_mismatch_aggregates()
    if kept:
        lines.append(f"  mismatch aggregates kept under their own names (not rlwatch's definitions, not judged): "
                     f"{_safe(', '.join(kept[:8]))}{', ...' if len(kept) > 8 else ''}")
    for key, steps in sorted(run.nonfinite.items())[:6]:
        lines.append(f"  {_safe(key)} logged non-finite at {len(steps)} step{'s' if len(steps) > 1 else ''} "
                     f"(first {steps[0]})")
    return lines


def _range_rows(result: ReplayResult) -> list[str]:
    """One line per step range: the reward's mean and range over it, and what happened in it."""
    run = result.run
    n = len(run.steps)
    size = max(1, -(-n // RANGES))
    series = dict(run.series(run.reward_key)) if run.reward_key else {}
    peak = result.postmortem.get("peak") or {}
    quality = _quality(result)
    peak_name, collapse_name = ("reward peak", "COLLAPSE") if quality is None else \
        (f"{quality} peak", f"COLLAPSE of {quality}")
    out = [f"  {'steps':>13}  {'reward mean':>11}  {'min..max':>19}  events"]
    for start in range(0, n, size):
        steps = run.steps[start:start + size]
        lo, hi = steps[0], steps[-1]
        values = [series[s] for s in steps if s in series]
        events = []
        if peak.get("step") is not None and lo <= peak["step"] <= hi:
            events.append(f"{peak_name} {_fmt(peak.get('value'))} at {peak['step']}")
        if result.collapse_step is not None and lo <= result.collapse_step <= hi:
            events.append(f"{collapse_name} at {result.collapse_step}")
        events += [f"{'PAGE' if a.severity == 'critical' else a.severity} {a.name} {a.state} at {a.step}"
                   for a in result.alerts if a.step is not None and lo <= a.step <= hi]
        mean = sum(values) / len(values) if values else None
        spread = f"{_fmt(min(values))}..{_fmt(max(values))}" if values else "-"
        out.append(f"  {f'{lo}-{hi}':>13}  {_fmt(mean):>11}  {spread:>19}  {_safe('; '.join(events))}")
    return out


def _verdict(result: ReplayResult) -> str:
    collapse = result.collapse_step

    def when(step: int | None) -> str:
        if step is None:
            return "none"
        if collapse is None:
            return f"step {step}"
        lead = collapse - step
        return f"step {step} ({lead} steps before the collapse)" if lead > 0 else \
            f"step {step} (at the collapse)" if lead == 0 else f"step {step} ({-lead} steps after the collapse)"

    head = f"collapse: step {collapse}" if collapse is not None else "collapse: none dated"
    return f"{head}; first page: {when(result.first_page_step)}; first warning: {when(result.first_warning_step)}"


def text(result: ReplayResult) -> str:
    """The replay's summary: the header, the reward table with the alerts marked, the verdict."""
    fired = [a for a in result.alerts if a.state == "fired"]
    lines = _header(result) + ["", *_range_rows(result), "", _verdict(result),
                               f"alerts fired: {len(fired)}"
                               + (f" ({', '.join(sorted({_safe(a.name) for a in fired}))})" if fired else "")]
    return "\n".join(lines)
