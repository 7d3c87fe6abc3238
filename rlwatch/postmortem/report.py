"""Render a post-mortem: a terminal report (rich), a markdown report with PNG plots, JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .analysis import Report
from .sources import RunData

PLOTTED = [("quality", "Run quality"), ("mismatch_kl_k3", "KL(mu||pi_old), k3"),
           ("mismatch_abs_log_ratio_p99", "|log ratio| p99"), ("is_ess_ratio", "Effective sample size"),
           ("version_lag_max", "Max version lag"), ("entropy_mean", "Entropy"),
           ("env_hack_ratio", "Hack rate by environment")]


def headline(report: Report) -> str:
    critical = report.first_critical
    if report.collapse_step is None:
        text = f"run {report.run}: no collapse of {report.quality_signal or 'quality'} detected"
    else:
        text = f"run {report.run}: {report.quality_signal} collapsed at step {report.collapse_step}"
        if critical is not None:
            lead = report.collapse_step - critical["step"]
            text += (f"; {critical['name']} fired {lead} steps before the collapse (step {critical['step']})"
                     if lead >= 0 else f"; the first critical alert came {-lead} steps after it")
        else:
            text += "; no critical alert fired before it"
    return text


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def probe_lines(report: Report) -> list[str]:
    """One line per probed checkpoint: mean log-prob of the stored responses, KL to the next one."""
    return [f"  step {r['step']:>5}  mean log p {_fmt(r.get('mean_logp'))}  KL to next {_fmt(r.get('kl_to_next'))}"
            + (f"  ERROR {r['error']}" if r.get("error") else "") + f"  {r['path']}" for r in report.probe]


def terminal(report: Report, console: Any = None) -> str:
    """Print (with rich when installed) and return the plain-text report."""
    lines = [headline(report), f"source: {report.source}"]
    if report.steps:
        lines.append(f"steps {report.steps[0]}..{report.steps[1]}")
    if report.peak:
        lines.append(f"peak {report.quality_signal} {report.peak[1]:.4g} at step {report.peak[0]}")
    lines.append(f"cause: {report.diagnosis.cause} ({report.diagnosis.confidence})")
    lines += [f"  - {e}" for e in report.diagnosis.evidence]
    lines.append("signals that moved first:")
    for f in report.first_signals[:8]:
        lead = f", {f.lead} steps before the collapse" if f.lead is not None else ""
        lines.append(f"  step {f.step:>5}  {f.name}: {f.baseline:.4g} -> {f.value:.4g}{lead}")
    lines.append("alerts:")
    for a in report.alerts[:20]:
        labels = ",".join(f"{k}={v}" for k, v in sorted(a.get("labels", {}).items()))
        lines.append(f"  step {a.get('step')!s:>5}  {a.get('severity', ''):<8} {a['name']} {labels}")
    if report.hacks:
        lines.append("reward hacks:")
        for h in report.hacks:
            lines.append(f"  {h['env']} / {h['detector']}: {h['early_rate']:.1%} -> {h['late_rate']:.1%}")
            for e in h["examples"][:2]:
                lines.append(f"    step {e['step']}: {e['reason']}: {e['response'][:80]!r}")
    if report.probe:
        lines.append("checkpoint probe (how far each update moved the policy on the stored rollouts):")
        lines += probe_lines(report)
    ckpt = report.last_healthy_checkpoint
    lines.append(f"last healthy checkpoint: {ckpt[1]} (step {ckpt[0]})" if ckpt else
                 "last healthy checkpoint: none recorded before the trouble")
    text = "\n".join(lines)
    try:
        from rich.console import Console
        from rich.panel import Panel
        from rich.table import Table

        console = console or Console()
        style = "red" if report.collapse_step is not None else "green"
        console.print(Panel(headline(report), style=style, title="rlwatch post-mortem"))
        table = Table(title="Signals that moved first")
        for col in ("step", "signal", "baseline", "value", "lead (steps)"):
            table.add_column(col)
        for f in report.first_signals[:8]:
            table.add_row(str(f.step), f.name, f"{f.baseline:.4g}", f"{f.value:.4g}", str(f.lead))
        console.print(table)
        alerts = Table(title="Alert timeline")
        for col in ("step", "severity", "alert", "labels"):
            alerts.add_column(col)
        for a in report.alerts[:20]:
            alerts.add_row(str(a.get("step")), a.get("severity", ""), a["name"],
                           ",".join(f"{k}={v}" for k, v in sorted(a.get("labels", {}).items())))
        console.print(alerts)
        console.print(f"[bold]Cause:[/bold] {report.diagnosis.cause} ({report.diagnosis.confidence})")
        for e in report.diagnosis.evidence:
            console.print(f"  - {e}")
        for h in report.hacks:
            console.print(f"[bold]Reward hack[/bold] {h['env']} / {h['detector']}: "
                          f"{h['early_rate']:.1%} -> {h['late_rate']:.1%}")
        if report.probe:
            probe = Table(title="Checkpoint probe (on the stored rollouts)")
            for col in ("step", "mean log p", "KL to next", "checkpoint", "error"):
                probe.add_column(col, overflow="fold")
            for r in report.probe:
                probe.add_row(str(r["step"]), _fmt(r.get("mean_logp")), _fmt(r.get("kl_to_next")), r["path"],
                              r.get("error") or "")
            console.print(probe)
        console.print("[bold]Last healthy checkpoint:[/bold] " + (f"{ckpt[1]} (step {ckpt[0]})" if ckpt else "none"))
    except ImportError:
        print(text)
    return text


def plots(report: Report, data: RunData, directory: Path) -> list[Path]:
    """PNG plots of the key signals with alert (red) and checkpoint (grey) markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .analysis import quality_series

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    critical = [a["step"] for a in report.alerts if a.get("severity") == "critical" and a.get("step") is not None]
    warnings = [a["step"] for a in report.alerts if a.get("severity") == "warning" and a.get("step") is not None]
    for key, title in PLOTTED:
        if key == "quality":
            label, series_list = quality_series(data)
            series_list = [(label or "quality", series_list)] if series_list else []
        else:
            label_sets = sorted(data.label_sets(key)) or [()]
            series_list = [(",".join(l for l in labels if l) or key, data.series(key, labels))
                           for labels in label_sets]
            series_list = [(n, s) for n, s in series_list if s]
        if not series_list:
            continue
        fig, ax = plt.subplots(figsize=(8, 3))
        for name, series in series_list:
            ax.plot([s for s, _ in series], [v for _, v in series], label=name, lw=1.2)
        for step in sorted(set(warnings)):
            ax.axvline(step, color="orange", lw=0.8, ls=":")
        for step in sorted(set(critical)):
            ax.axvline(step, color="red", lw=1.0, ls="--")
        for step, _ in data.checkpoints:
            ax.axvline(step, color="grey", lw=0.5, alpha=0.5)
        if report.collapse_step is not None:
            ax.axvspan(report.collapse_step, report.steps[1] if report.steps else report.collapse_step,
                       color="red", alpha=0.07)
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(series_list) > 1 or key == "quality":
            ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = directory / f"{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def markdown(report: Report, images: list[Path], directory: Path) -> Path:
    lines = [f"# Post-mortem: {report.run}", "", f"**{headline(report)}.**", "", f"Source: {report.source}.", ""]
    lines += ["## Cause", "", f"**{report.diagnosis.cause}** ({report.diagnosis.confidence} confidence)", ""]
    lines += [f"- {e}" for e in report.diagnosis.evidence] + [""]
    lines += ["## Signals that moved first", "", "| step | signal | baseline | value | lead (steps) |",
              "|---|---|---|---|---|"]
    lines += [f"| {f.step} | `{f.name}` | {f.baseline:.4g} | {f.value:.4g} | {f.lead} |" for f in report.first_signals]
    lines += ["", "## Alert timeline", "", "| step | severity | alert | labels |", "|---|---|---|---|"]
    lines += [f"| {a.get('step')} | {a.get('severity', '')} | {a['name']} | "
              f"{', '.join(f'{k}={v}' for k, v in sorted(a.get('labels', {}).items()))} |" for a in report.alerts]
    if report.hacks:
        lines += ["", "## Reward hacks", ""]
        for h in report.hacks:
            lines.append(f"- **{h['env']} / {h['detector']}**: {h['early_rate']:.1%} early, "
                         f"{h['late_rate']:.1%} late")
            for e in h["examples"]:
                lines.append(f"  - step {e['step']}, reward {e['reward']}: {e['reason']} - `{e['response'][:120]}`")
    if report.probe:
        lines += ["", "## Checkpoint probe", "",
                  "Mean log-prob of the stored rollouts' response tokens under each checkpoint, and the mean "
                  "per-token KL to the next checkpoint (how far that update moved the policy).", "",
                  "| step | mean log p | KL to next | checkpoint | error |", "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {_fmt(r.get('mean_logp'))} | {_fmt(r.get('kl_to_next'))} | `{r['path']}` | "
                  f"{r.get('error') or ''} |" for r in report.probe]
    ckpt = report.last_healthy_checkpoint
    lines += ["", "## Resume from", "", f"`{ckpt[1]}` (step {ckpt[0]})" if ckpt else "No checkpoint before the trouble.",
              "", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in images]
    path = directory / "postmortem.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_json(report: Report, path: Path | None = None) -> str:
    text = json.dumps(report.as_json(), indent=2, default=str)
    if path is not None:
        path.write_text(text)
    return text
