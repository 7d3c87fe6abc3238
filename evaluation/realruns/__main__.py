"""``python -m evaluation.realruns [--split tuning|test|all] [--feed replay|observe] [--out DIR]``: replay
every corpus run of the split at the shipped alert defaults (``--feed observe``: feed it as a custom loop
would, :mod:`evaluation.realruns.observe`) and print, per split, the collapses paged and warned before
the authors' collapse step (with the lead), the healthy runs paged, flapping and each alert's
precision; ``--out DIR`` also writes ``realruns.json`` there (figures and per-run detail); ``--write-doc``
rewrites the figures block of docs/real-runs.md (``--check-doc``: exit 1 when it is stale)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from . import report as doc
from .corpus import MANIFEST, SPLITS, runs
from .score import FEEDS, RunScore, Summary, score_run, summarise


def _fmt_lead(lead: tuple[int, float] | None) -> str:
    return f"{lead[0]} steps ({lead[1]:.0%} of the run)" if lead else "-"


def _run_line(s: RunScore) -> str:
    where = f"collapse@{s.collapse_step}" if s.collapse_step is not None else s.outcome
    first = ", ".join(f"{name}@{step}" for step, name, _ in s.fired[:4]) or "none"
    more = f" (+{len(s.fired) - 4} more)" if len(s.fired) > 4 else ""
    return (f"  {s.id:<34} {where:<15} steps {s.first_step}-{s.last_step:<4} page@{s.first_page_step} "
            f"warn@{s.first_warning_step} lead {_fmt_lead(s.lead(s.first_page_step))}; fired: {first}{more}")


def _figures(m: Summary) -> list[str]:
    lines = [f"== {m.split}: {m.collapses} collapses, {m.healthy} healthy, {m.unresolved} unresolved =="]
    if m.collapses:
        lead = (f"median lead {m.median_page_lead_steps:g} steps ({m.median_page_lead_fraction:.0%} of the run)"
                if m.median_page_lead_steps is not None else "no lead")
        lines.append(f"collapses paged before the authors' step: {m.paged_before}/{m.collapses}, {lead}")
        lines.append(f"collapses warned (any alert) before: {m.warned_before}/{m.collapses}"
                     + (f", median lead {m.median_alert_lead_steps:g} steps" if m.median_alert_lead_steps is not None
                        else ""))
    lines.append(f"healthy runs paged: {m.healthy_paged}/{m.healthy}; warned: {m.healthy_warned}/{m.healthy}")
    lines.append(f"flapping (re-fire within a few rows of resolving): {m.flaps}")
    for name, row in m.alerts.items():
        prec = "-" if row["precision"] is None else f"{row['precision']:.2f}"
        early = "-" if row["precision_before"] is None else f"{row['precision_before']:.2f}"
        lines.append(f"  {name:<32} {row['severity']:<8} collapsed {row['collapsed_runs']} "
                     f"(before {row['before_collapse']}), healthy {row['healthy_runs']}: precision {prec}, "
                     f"before the collapse {early}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.realruns", description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=(*SPLITS, "all"), default="all")
    parser.add_argument("--feed", choices=FEEDS, default="replay",
                        help="replay each log (default), or feed it through observe as a custom loop would")
    parser.add_argument("--out", help="directory for realruns.json and the replay stores")
    parser.add_argument("--manifest", default=str(MANIFEST), help=argparse.SUPPRESS)
    parser.add_argument("--write-doc", action="store_true", help="rewrite the figures block of docs/real-runs.md")
    parser.add_argument("--check-doc", action="store_true", help="exit 1 when docs/real-runs.md's figures are stale")
    args = parser.parse_args(argv)
    if args.feed != "replay" and (args.write_doc or args.check_doc):
        parser.error("the figures block of docs/real-runs.md is the replay's (no --feed)")
    splits = SPLITS if args.split == "all" or args.write_doc or args.check_doc else (args.split,)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rlwatch-realruns-"))
    stores = work / "stores"
    report: dict[str, dict] = {}
    summaries, every = [], []
    for split in splits:
        scores = [score_run(entry, stores, feed=args.feed) for entry in runs(split, Path(args.manifest))]
        summary = summarise(split, scores)
        summaries.append(summary)
        every += scores
        if not args.check_doc:
            print("\n".join(_figures(summary)))
            print("\n".join(_run_line(s) for s in scores))
        report[split] = {"figures": asdict(summary), "runs": [s.as_dict() for s in scores]}
    if args.write_doc or args.check_doc:
        from .headroom import doc_rows

        if not doc.write(doc.block(summaries, every, doc_rows()), check=args.check_doc):
            print(f"{doc.DOC} is stale: python -m evaluation.realruns --write-doc", file=sys.stderr)
            return 1
    if args.out:
        work.mkdir(parents=True, exist_ok=True)
        (work / "realruns.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        print(f"wrote {work / 'realruns.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
