"""The post-mortem's PNG plots: the overview signals, each first mover with its change marked, and
(with a baseline) both runs' curves of every diverged signal."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .analysis import Report
from .report import _fmt, _mpl
from .sources import RunData

PLOTTED = [("quality", "Run quality"), ("mismatch_kl_k3", "KL(mu||pi_old), k3"),
           ("mismatch_abs_log_ratio_p99", "|log ratio| p99"), ("is_ess_ratio", "Effective sample size"),
           ("version_lag_max", "Max version lag"), ("entropy_mean", "Entropy"),
           ("env_hack_ratio", "Hack rate by environment")]
PLOTTED_CHANGES = 8       # signals that get their own plot with the change marked


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:80] or "signal"


def _events(ax: Any, report: Report, data: RunData) -> None:
    """Alerts, checkpoints and the collapse, each with a legend entry."""
    warnings = sorted({a["step"] for a in report.alerts if a.get("step") is not None
                       and a.get("severity") != "critical"})
    critical = sorted({a["step"] for a in report.alerts if a.get("step") is not None
                       and a.get("severity") == "critical"})
    for i, step in enumerate(warnings):
        ax.axvline(step, color="orange", lw=0.8, ls=":", label="warning alert fired" if i == 0 else None)
    for i, step in enumerate(critical):
        ax.axvline(step, color="red", lw=1.0, ls="--", label="critical alert fired" if i == 0 else None)
    for i, (step, _) in enumerate(data.checkpoints):
        ax.axvline(step, color="grey", lw=0.5, alpha=0.5, label="checkpoint" if i == 0 else None)
    if report.collapse_step is not None:
        ax.axvspan(report.collapse_step, report.steps[1] if report.steps else report.collapse_step,
                   color="red", alpha=0.07, label="after the collapse")


class _Figures:
    """Where the plots go: ``new()`` opens an 8x3 figure, ``save`` titles, writes and closes it."""

    def __init__(self, plt: Any, directory: Path) -> None:
        self.plt = plt
        self.directory = directory
        self.written: list[Path] = []

    def new(self) -> tuple[Any, Any]:
        return self.plt.subplots(figsize=(8, 3))

    def save(self, fig: Any, ax: Any, title: str, name: str) -> None:
        ax.set_title(title)
        ax.set_xlabel("step")
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = self.directory / f"{name}.png"
        fig.savefig(path, dpi=100)
        self.plt.close(fig)
        self.written.append(path)


def plots(report: Report, data: RunData, directory: Path, baseline: RunData | None = None) -> list[Path]:
    """PNG plots: the overview signals, each first mover with its change marked, and (with a
    baseline) both runs' curves of every diverged signal. Returns the written paths."""
    try:
        import logging

        logging.getLogger("matplotlib").setLevel(logging.WARNING)      # no "generated new fontManager"
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    figures = _Figures(plt, directory)
    _overview_plots(figures, report, data)
    _change_plots(figures, report, data)
    if baseline is not None and report.comparison is not None:
        _comparison_plots(figures, report, data, baseline)
    return figures.written


def _overview_plots(figures: _Figures, report: Report, data: RunData) -> None:
    """One plot per :data:`PLOTTED` signal the run has (a line per label set), with the events."""
    from .analysis import quality_series

    for key, title in PLOTTED:
        if key == "quality":
            qk, series = quality_series(data)
            series_list = [(qk or "quality", series)]
        else:
            series_list = [(",".join(x for x in labels if x) or key, data.series(key, labels))
                           for labels in sorted(data.label_sets(key))] or [(key, data.series(key))]
        series_list = [(n, s) for n, s in series_list if s]
        if not series_list:
            continue
        fig, ax = figures.new()
        for name, series in series_list:
            ax.plot([s for s, _ in series], [v for _, v in series], label=_mpl(name), lw=1.2)
        _events(ax, report, data)
        figures.save(fig, ax, title, key)


def _change_plots(figures: _Figures, report: Report, data: RunData) -> None:
    """The first :data:`PLOTTED_CHANGES` first movers: reference level, noise band, change and alarm."""
    for i, change in enumerate(report.first_signals[:PLOTTED_CHANGES]):
        series = data.series(change.signal, change.labels)
        fig, ax = figures.new()
        ax.plot([s for s, _ in series], [v for _, v in series], lw=1.2, color="C0", label=_mpl(change.name))
        ax.axhline(change.before, color="C2", lw=0.8, ls="--", label=f"reference level {_fmt(change.before)}")
        ax.axhspan(change.before - change.noise, change.before + change.noise, color="C2", alpha=0.1,
                   label=f"+/- noise {_fmt(change.noise)}")
        ax.axvline(change.step, color="C3", lw=1.5, label=f"change from step {change.step}")
        ax.axvline(change.alarm_step, color="C3", lw=0.8, ls=":", label=f"confirmed at step {change.alarm_step}")
        if report.collapse_step is not None:
            ax.axvline(report.collapse_step, color="k", lw=1.0, ls="-.", label=f"collapse at {report.collapse_step}")
        figures.save(fig, ax, f"{_mpl(change.name)}: changed at step {change.step}",
                     f"change-{i + 1:02d}-{_slug(change.name)}")


def _comparison_plots(figures: _Figures, report: Report, data: RunData, baseline: RunData) -> None:
    """Both runs' curves of the first diverged signals, and of the quality signal."""
    from .analysis import quality_series

    good_label = _mpl(f"good: {baseline.run}")
    bad_label = _mpl(f"this run: {data.run}")
    keys = [(d.signal, d.labels, d.step) for d in report.comparison.divergences[:PLOTTED_CHANGES]]
    qk, _ = quality_series(data)
    if qk and qk not in {k[0] for k in keys}:
        keys.append((qk, (), None))
    for i, (signal, labels, step) in enumerate(keys):
        mine, theirs = data.series(signal, labels), baseline.series(signal, labels)
        if not mine or not theirs:
            continue
        fig, ax = figures.new()
        ax.plot([s for s, _ in theirs], [v for _, v in theirs], lw=1.2, color="C2", label=good_label)
        ax.plot([s for s, _ in mine], [v for _, v in mine], lw=1.2, color="C3", label=bad_label)
        if step is not None:
            ax.axvline(step, color="k", lw=1.0, ls="--", label=f"diverged from step {step}")
        name = signal + (f"{{{','.join(x for x in labels if x)}}}" if any(labels) else "")
        figures.save(fig, ax, f"{_mpl(name)}: this run against the good run", f"compare-{i + 1:02d}-{_slug(name)}")
