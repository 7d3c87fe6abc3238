"""Render a post-mortem: a terminal report (rich), a markdown report with PNG plots, JSON.

Every string that came from a run (run, environment, detector, alert and label names, paths,
hack examples, event details) is untrusted: :func:`safe` shows control characters, escape
sequences (ESC, OSC), bidirectional overrides and lone surrogates as visible escapes; rich gets
``Text`` objects (never markup); markdown escapes its own syntax; matplotlib its mathtext.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

from .analysis import NO_CAUSE, Report
from .changes import REFERENCE_POINTS, Change
from .compare import Comparison

SHOWN_CHANGES = 10        # rows of the first-movers table in the terminal (all of them in markdown / JSON)


def safe(value: Any, limit: int | None = None) -> str:
    """``value`` as one printable line: control/format characters and lone surrogates escaped."""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    out = []
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn") and ch != " ":
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def code(value: Any, limit: int | None = None) -> str:
    """Untrusted text as a markdown code span (nothing inside is markup)."""
    return "`" + safe(value, limit).replace("`", "'").replace("|", "\\|") + "`"


_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()<>#+!|~])")


def md(value: Any, limit: int | None = None) -> str:
    """Untrusted text for markdown: safe, then markdown's syntax characters escaped."""
    return _MD_SPECIAL.sub(r"\\\1", safe(value, limit))


def _mpl(value: Any) -> str:
    """Untrusted text for matplotlib: safe, and no mathtext."""
    return safe(value, 80).replace("$", r"\$")


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return "0" if value == 0 else f"{value:.4g}"


def _lead(lead: int | None) -> str:
    if lead is None:
        return "-"
    return f"{lead} before the collapse" if lead > 0 else "at the collapse" if lead == 0 else \
        f"{-lead} after the collapse"


def _size(change: Any) -> str:
    size = change.size
    return "above its floor" if size != size or abs(size) == float("inf") else f"{size:+.1f}x noise"


def headline(report: Report) -> str:
    critical = report.first_critical
    if report.collapse_step is None:
        text = (f"run {report.run}: no collapse of {report.quality_signal} detected" if report.quality_signal else
                f"run {report.run}: no quality signal (held-out score or reward), so no collapse can be dated")
    else:
        text = f"run {report.run}: {report.quality_signal} collapsed at step {report.collapse_step}"
        recovered = report.collapse.recovery_text() if report.collapse is not None else None
        text += f" ({recovered})" if recovered else ""
        if critical is not None:
            lead = report.collapse_step - critical["step"]
            text += (f"; {critical['name']} fired {lead} steps before the collapse (step {critical['step']})"
                     if lead > 0 else f"; {critical['name']} fired at the collapse step" if lead == 0
                     else f"; the first critical alert came {-lead} steps after it")
        else:
            text += "; no critical alert fired before it"
    return safe(text)


def _confidence(report: Report) -> str:
    """The confidence of a diagnosed cause, with the accuracy it stands for on the labelled evaluation."""
    if report.cause != report.diagnosis.cause:
        return ""
    accuracy = report.diagnosis.accuracy
    return f" ({report.diagnosis.confidence} confidence" + (
        f": {accuracy:.0%} of alike verdicts right in the labelled evaluation runs, docs/diagnosis-evaluation.md)"
        if accuracy is not None else ")")


def cause_line(report: Report) -> str:
    if report.cause == NO_CAUSE:
        return "cause: no cause found" + (f" ({report.explanation})" if report.explanation else "")
    return f"cause: {report.cause_name}{_confidence(report)}"


def resume_line(report: Report) -> str:
    r = report.resume
    if r is None:
        return "resume: nothing recommended"
    if r.checkpoint:
        return f"resume from: {safe(r.checkpoint[1])} (step {r.checkpoint[0]}): {safe(r.reason)}"
    return f"resume: nothing recommended: {safe(r.reason)}"


def _level(c: Change, value: float) -> str:
    """A change's level: hack rates as percentages (as the hack section gives them)."""
    return f"{value:.1%}" if c.signal == "env_hack_ratio" else _fmt(value)


def change_line(c: Change) -> str:
    return (f"step {c.step:>5}  {safe(c.name)}: {_level(c, c.before)} -> {_level(c, c.after)} ({_size(c)}"
            f"{'' if c.concerning else ', not a trouble direction'})"
            + (f", {_lead(c.lead)}" if c.lead is not None else ""))


def probe_lines(report: Report) -> list[str]:
    """One line per probed checkpoint: mean log-prob of the stored responses, KL to the next one."""
    return [f"  step {r['step']:>5}  mean log p {_fmt(r.get('mean_logp'))}  KL to next {_fmt(r.get('kl_to_next'))}"
            + (f"  ERROR {safe(r['error'], 300)}" if r.get("error") else "") + f"  {safe(r['path'])}"
            for r in report.probe]


def comparison_lines(c: Comparison) -> list[str]:
    lines = [f"compared with {safe(c.good)}:"]
    if c.common_steps is None:
        return lines + ["  the two runs have no step in common"]
    lines.append(f"  steps {c.common_steps[0]}..{c.common_steps[1]} in common ({c.common_steps[2]} steps), "
                 f"{len(c.compared)} signals compared")
    if not c.divergences:
        lines.append("  diverged: none (no signal left the good run's by more than its noise)")
    else:
        lines.append("  diverged (this run against the good run: medians over the steps given):")
    for d in c.divergences:
        lines.append(f"  from step {d.step:>5}  {safe(d.name)}: {_fmt(d.bad)} against {_fmt(d.good)} "
                     f"(steps {d.window[0]}..{d.window[1]}; difference {_fmt(d.difference)}, {_size(d)})")
    if c.only_bad:
        lines.append(f"  only in this run: {safe(', '.join(c.only_bad), 400)}")
    if c.only_good:
        lines.append(f"  only in the good run: {safe(', '.join(c.only_good), 400)}")
    return lines


def coverage_lines(report: Report) -> list[str]:
    cov = report.coverage
    lines = ["coverage:"]
    lines += [f"  carried: {c['family']} ({c['steps']} steps)" for c in cov.carried]
    lines += [f"  not carried: {m['family']}: {m['why']}" for m in cov.missing]
    lines += [f"  note: {safe(n, 300)}" for n in cov.notes]
    return lines


def text_report(report: Report) -> str:
    """The whole report as plain text (what the terminal shows, without colour)."""
    lines = [headline(report), f"source: {safe(report.source)}"]
    lines += concurrent_lines(report)
    if report.steps:
        lines.append(f"steps {report.steps[0]}..{report.steps[1]}")
    if report.missing_steps:
        lines.append(safe(report.missing_steps.text()))
    if report.peak:
        lines.append(f"peak {report.quality_signal} {_fmt(report.peak[1])} at step {report.peak[0]}")
    lines.append(cause_line(report))
    lines += [f"  - {safe(e)}" for e in report.evidence]
    lines += [f"held: {safe(report.correction_held)}"] if report.correction_held else []
    if report.first_signals:
        lines.append("signals that changed first:")
        lines += ["  " + change_line(c) for c in report.first_signals[:SHOWN_CHANGES]]
        if len(report.first_signals) > SHOWN_CHANGES:
            lines.append(f"  ... and {len(report.first_signals) - SHOWN_CHANGES} more (see --out or --json)")
    elif report.steps is not None and report.steps[1] - report.steps[0] + 1 < REFERENCE_POINTS + 2:
        lines.append(f"signals that changed first: none can be dated (steps {report.steps[0]}..{report.steps[1]}; "
                     f"the change test needs at least {REFERENCE_POINTS + 2} steps)")
    else:
        lines.append("signals that changed first: none (no signal moved by more than its noise)")
    if report.alerts:
        lines.append("alerts:")
        for a in report.alerts[:20]:
            labels = ",".join(f"{k}={v}" for k, v in sorted(a.get("labels", {}).items()))
            by = f"  (attempt {safe(a.get('attempt'))})" if report.concurrent_writers and a.get("attempt") else ""
            lines.append(f"  step {_fmt(a.get('step')):>5}  {safe(a.get('severity', '')):<8} {safe(a['name'])} "
                         f"{safe(labels, 200)}{by}")
        if len(report.alerts) > 20:
            lines.append(f"  ... and {len(report.alerts) - 20} more")
    else:
        lines.append("alerts: none fired")
    lines += superseded_lines(report)
    if report.hacks:
        lines.append("reward hacks:")
        for h in report.hacks:
            lines.append(f"  {safe(h['env'])} / {safe(h['detector'])}: {h['early_rate']:.1%} -> {h['late_rate']:.1%}"
                         + (f" from step {h['step']}" if h.get("step") is not None else ""))
            for e in h["examples"][:2]:
                lines.append(f"    step {e['step']}: {safe(e['reason'], 120)}: {safe(repr(e['response']), 80)}")
    if report.probe:
        lines.append("Checkpoint probe (how far each update moved the policy on the stored rollouts):")
        lines += probe_lines(report)
    lines.append(resume_line(report))
    lines += coverage_lines(report)
    if report.comparison is not None:
        lines += comparison_lines(report.comparison)
    return "\n".join(lines)


def concurrent_lines(report: Report, bullet: str = "  ") -> list[str]:
    """Processes that wrote the run at the same time: not a resume, and their steps are interleaved."""
    lines = []
    for group in report.concurrent_writers:
        lines.append(f"concurrent writers: {len(group)} processes wrote this run at the same time (one run name, "
                     "one store); this is not a resume: every process's alerts are listed, and each step holds "
                     "the row written last, so the signals mix the processes (give each process its own run name)")
        lines += [f"{bullet}attempt {safe(a['id'])}: pid {a.get('pid')}, host {safe(a.get('host'))}, steps "
                  f"{a.get('first_step')}..{a.get('last_step')}" for a in group]
    return lines


def superseded_lines(report: Report, bullet: str = "  ") -> list[str]:
    """Alerts and checkpoints of attempts that a later attempt replaced by resuming at or before their
    step: from the run's history, not its final timeline."""
    rows = [(a["step"], a["attempt"], a["superseded_by"], a["resumed_at"],
             f"{safe(a.get('severity', ''))} {safe(a['name'])} "
             + safe(",".join(f"{k}={v}" for k, v in sorted(a.get("labels", {}).items())), 200))
            for a in report.superseded_alerts]
    rows += [(c["step"], c["attempt"], c["superseded_by"], c["resumed_at"], f"checkpoint {safe(c['path'], 200)}")
             for c in report.superseded_checkpoints]
    if not rows:
        return []
    lines = ["superseded attempts (a later attempt resumed before these steps; not part of the timeline above):"]
    for step, attempt, by, resumed_at, what in sorted(rows, key=lambda r: (r[1], r[0])):
        lines.append(f"{bullet}step {step:>5}  {what}  (attempt {safe(attempt)}, replaced from step {resumed_at} "
                     f"by attempt {safe(by)})")
    return lines


def terminal(report: Report, console: Any = None) -> str:
    """Print (with rich when installed) and return the plain-text report. Nothing from the run is
    ever read as rich markup."""
    text = text_report(report)
    try:
        from rich.console import Console
        from rich.panel import Panel
        from rich.text import Text
    except ImportError:
        print(text)
        return text
    console = console or Console(highlight=False)
    style = "red" if report.collapse_step is not None else "green"
    body = text.split("\n", 1)[1] if "\n" in text else ""
    console.print(Panel(Text(headline(report)), style=style, title="rlwatch post-mortem"))
    console.print(Text(body), markup=False, highlight=False)
    return text


# --- markdown -----------------------------------------------------------------------------------------

def markdown(report: Report, images: list[Path], directory: Path) -> Path:
    """Write ``directory/postmortem.md``: headline, cause, first changes, alerts, hacks, probe, resume
    point, coverage, the comparison with a good run and the plots (``images``). Returns its path."""
    lines = [f"# Post-mortem: {md(report.run)}", "", f"**{md(headline(report))}.**", "",
             f"Source: {md(report.source)}.", ""]
    if report.missing_steps:
        lines += [f"**{md(report.missing_steps.text().capitalize())}.**", ""]
    lines += _md_cause(report) + _md_changes(report) + _md_alerts(report) + _md_hacks(report) + _md_probe(report)
    if concurrent := concurrent_lines(report, bullet=""):
        lines += ["", "## Concurrent writers", "", md(concurrent[0]), ""] + [f"- {md(x)}" for x in concurrent[1:]]
    if superseded := superseded_lines(report, bullet=""):
        lines += ["", "## Superseded attempts", "", md(superseded[0]), ""] + [f"- {md(x)}" for x in superseded[1:]]
    lines += _md_resume_and_coverage(report)
    if report.comparison is not None:
        lines += _md_comparison(report.comparison)
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in images] if images else ["None (matplotlib is not installed)."]
    path = directory / "postmortem.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _md_cause(report: Report) -> list[str]:
    if report.cause == NO_CAUSE:
        lines = ["## Cause", "", "**No cause found.**" + (f" The {report.explanation}." if report.explanation else ""),
                 ""]
    else:
        lines = ["## Cause", "", f"**{md(report.cause_name)}**{_confidence(report)}", ""]
    held = [f"**Held by a correction**: {md(report.correction_held)}.", ""] if report.correction_held else []
    return lines + [f"- {md(e)}" for e in report.evidence] + [""] + held


def _md_changes(report: Report) -> list[str]:
    lines = ["## Signals that changed first", "",
             "Each signal's first change found by a two-sided CUSUM over the whole run (reference: its first "
             "values; noise: robust, floored at the smallest meaningful shift).", ""]
    if not report.first_signals:
        return lines + ["None: no signal moved by more than its noise."]
    lines += ["| from step | confirmed | signal | before | after | size | lead |", "|---|---|---|---|---|---|---|"]
    return lines + [f"| {c.step} | {c.alarm_step} | {code(c.name)} | {_level(c, c.before)} | "
                    f"{_level(c, c.after)} | {_size(c)}{'' if c.concerning else ' (not a trouble direction)'} | "
                    f"{_lead(c.lead)} |" for c in report.first_signals]


def _md_alerts(report: Report) -> list[str]:
    lines = ["", "## Alert timeline", ""]
    if not report.alerts:
        return lines + ["None fired."]
    lines += ["| step | severity | alert | labels |", "|---|---|---|---|"]
    return lines + [f"| {_fmt(a.get('step'))} | {md(a.get('severity', ''))} | {md(a['name'])} | "
                    f"{md(', '.join(f'{k}={v}' for k, v in sorted(a.get('labels', {}).items())), 300)} |"
                    for a in report.alerts]


def _md_hacks(report: Report) -> list[str]:
    if not report.hacks:
        return []
    lines = ["", "## Reward hacks", ""]
    for h in report.hacks:
        lines.append(f"- **{md(h['env'])} / {md(h['detector'])}**: {h['early_rate']:.1%} -> {h['late_rate']:.1%}"
                     + (f" from step {h['step']}" if h.get("step") is not None else ""))
        for e in h["examples"]:
            lines.append(f"  - step {e['step']}, reward {_fmt(e.get('reward'))}: {md(e['reason'], 200)}: "
                         f"{md(e['response'], 120)}")
    return lines


def _md_probe(report: Report) -> list[str]:
    if not report.probe:
        return []
    return ["", "## Checkpoint probe", "",
            "Mean log-prob of the stored rollouts' response tokens under each checkpoint, and the mean "
            "per-token KL to the next checkpoint (how far that update moved the policy).", "",
            "| step | mean log p | KL to next | checkpoint | error |", "|---|---|---|---|---|"] + [
        f"| {r['step']} | {_fmt(r.get('mean_logp'))} | {_fmt(r.get('kl_to_next'))} | {code(r['path'])} | "
        f"{md(r.get('error') or '', 300)} |" for r in report.probe]


def _md_resume_and_coverage(report: Report) -> list[str]:
    r = report.resume
    lines = ["", "## Resume from", ""]
    if r is not None and r.checkpoint:
        lines.append(f"{code(r.checkpoint[1])} (step {r.checkpoint[0]}): {md(r.reason)}.")
    else:
        lines.append(f"Nothing recommended: {md(r.reason) if r else 'no analysis'}.")
    cov = report.coverage
    lines += ["", "## Coverage", ""]
    lines += [f"- carried: {c['family']} ({c['steps']} steps)" for c in cov.carried]
    lines += [f"- **not carried: {m['family']}**: {m['why']}" for m in cov.missing]
    return lines + [f"- note: {md(n, 300)}" for n in cov.notes]


def _md_comparison(c: Comparison) -> list[str]:
    lines = ["", "## Against a good run", "", f"Good run: {md(c.good)}.", ""]
    if c.common_steps is None:
        return lines + ["The two runs have no step in common."]
    lines += [f"Aligned by step: {c.common_steps[0]}..{c.common_steps[1]} ({c.common_steps[2]} steps in "
              f"common), {len(c.compared)} signals compared (CUSUM on the per-step difference).", ""]
    if not c.divergences:
        return lines + ["Diverged: none (no signal left the good run's by more than its noise)."]
    lines += ["| from step | confirmed | signal | medians over steps | this run | good run | difference | size |",
              "|---|---|---|---|---|---|---|---|"]
    return lines + [f"| {d.step} | {d.alarm_step} | {code(d.name)} | {d.window[0]}..{d.window[1]} | {_fmt(d.bad)} | "
                    f"{_fmt(d.good)} | {_fmt(d.difference)} | {_size(d)} |" for d in c.divergences]
