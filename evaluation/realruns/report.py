"""The figures block of ``docs/real-runs.md``, written from a replay of the corpus at the shipped defaults
(``python -m evaluation.realruns --write-doc``; ``--check-doc`` exits 1 when the page's block differs)."""

from __future__ import annotations

from pathlib import Path

from .score import RunScore, Summary

DOC = Path(__file__).resolve().parents[2] / "docs" / "real-runs.md"
BEGIN, END = "<!-- realruns figures: python -m evaluation.realruns --write-doc -->", "<!-- /realruns figures -->"


def _lead(lead: tuple[int, float] | None) -> str:
    return f"{lead[0]} steps ({lead[1]:.0%} of the run)" if lead else "-"


def _summary_row(m: Summary) -> str:
    page = (f"{m.paged_before} of {m.collapses}" if m.collapses else "-")
    warn = (f"{m.warned_before} of {m.collapses}" + (f" (median {m.median_alert_lead_steps:g} steps ahead)"
                                                      if m.median_alert_lead_steps is not None else "")
            if m.collapses else "-")
    lead = (f"{m.median_page_lead_steps:g} steps ({m.median_page_lead_fraction:.0%} of the run)"
            if m.median_page_lead_steps is not None else "-")
    return (f"| {m.split} | {page} | {warn} | {lead} | {m.healthy_paged} of {m.healthy} | "
            f"{m.healthy_warned} of {m.healthy} | {m.unresolved} | {m.flaps} |")


def _alert_rows(m: Summary) -> list[str]:
    rows = [f"Per alert, {m.split} runs (collapsed runs it fired on, of them before the collapse; healthy runs it "
            "fired on):", "", "| alert | severity | collapsed (before) | healthy | precision | before the collapse |",
            "|---|---|---|---|---|---|"]
    for name, row in m.alerts.items():
        prec = "-" if row["precision"] is None else f"{row['precision']:.2f}"
        early = "-" if row["precision_before"] is None else f"{row['precision_before']:.2f}"
        rows.append(f"| {name} | {row['severity']} | {row['collapsed_runs']} ({row['before_collapse']}) | "
                    f"{row['healthy_runs']} | {prec} | {early} |")
    return rows + [""] if m.alerts else [f"No alert fired on the {m.split} runs.", ""]


def _run_row(s: RunScore) -> str:
    outcome = f"collapsed at {s.collapse_step}" if s.collapse_step is not None else s.outcome
    first: dict[str, int | None] = {}
    for step, name, _ in s.fired:
        first.setdefault(name, step)
    fired = ", ".join(f"{name.removeprefix('RLWatch')} {step}" for name, step in first.items()) or "none"
    return (f"| `{s.id}` | {s.split} | {outcome} | {s.first_page_step if s.first_page_step is not None else '-'} | "
            f"{s.first_warning_step if s.first_warning_step is not None else '-'} | "
            f"{_lead(s.lead(s.first_page_step))} | {fired} |")


def block(summaries: list[Summary], scores: list[RunScore], headroom: list[str] | None = None) -> str:
    """The markdown between the markers: the split figures, each alert's precision, each run's first alerts,
    and (``headroom``) the lead any threshold on the logged signals could have had."""
    lines = [BEGIN, "", "| split | collapses paged before the authors' step | warned before | median lead (page) | "
             "healthy runs paged | healthy runs warned | unresolved | flapping |", "|---|---|---|---|---|---|---|---|"]
    lines += [_summary_row(m) for m in summaries] + [""]
    for m in summaries:
        lines += _alert_rows(m)
    lines += ["Each run: the first page and the first warning (logged steps), the page's lead, and the first step "
              "each alert fired.", "", "| run | split | outcome | first page | first warning | page lead | "
              "alerts (first step) |", "|---|---|---|---|---|---|---|"]
    lines += [_run_row(s) for s in scores] + [""]
    if headroom:
        lines += ["How far the logs let any threshold lead (`python -m evaluation.realruns.headroom`, run-relative "
                  "statistics; see below):", "", *headroom, ""]
    lines.append(END)
    return "\n".join(lines)


def write(text: str, check: bool, path: Path = DOC) -> bool:
    """Put ``text`` (a :func:`block`) between the page's markers; with ``check``, only say whether it is there
    already. Returns True when the page holds it."""
    page = path.read_text(encoding="utf-8")
    start, end = page.index(BEGIN), page.index(END) + len(END)
    if page[start:end] == text:
        return True
    if not check:
        path.write_text(page[:start] + text + page[end:], encoding="utf-8")
    return not check
