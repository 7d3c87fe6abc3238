"""The acceptance report's Markdown (:mod:`evaluation.acceptance` computes its figures, scored by
:mod:`evaluation.acceptance_score`)."""

from __future__ import annotations

from .acceptance_score import STALENESS_BOUND, TUNED_PARAMS, Outcome, bars, score
from .matrix import FAMILIES


def _table(rows: list[dict]) -> list[str]:
    return ["| " + " | ".join(map(str, rows[0])) + " |", "|" + "---|" * len(rows[0]),
            *["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows]]


def _thresholds_text(thresholds: dict[str, float]) -> str:
    from rlwatch.alerts.params import PARAMS

    return ", ".join(f"`{k}`={thresholds.get(k, PARAMS[k].default):g}" for k in TUNED_PARAMS)


TUNING_RULE = (
    "The rule (`evaluation.acceptance.tune`): for each combination of lag factor, intermittent window and ESS "
    "floor in this order, the grid's KL bounds are tried; at the first combination where any meets every bar, "
    "the edges of the feasible interval are bisected (log space, to 5%) against the nearest grid bounds that "
    "miss a bar, and the bound is the geometric midpoint of the two edges (rows after the grid).")


SCALE_FREE = ("A critical condition on k3 divided by the policy's mean token entropy, opened as RLWatchKLSpike "
              "is (2 steps running or the intermittent window), at each bound; a shipped default would have to "
              "meet the bars on this matrix and mean the same on a language model.")


def markdown(command: str, at: dict[str, dict], tried: list[dict], summaries: dict[str, dict],
             checks: dict[str, dict], alerts: dict, outcomes: list[Outcome], agreement: dict, seconds: float,
             split: dict, ratio: dict[str, list[dict]]) -> str:
    """The report: bars and summary at the shipped defaults and at the tuned thresholds side by side,
    the tuned thresholds' per-alert table and runs, the tuning, the scale-free trial."""
    yes = lambda ok: "yes" if ok else "**no**"  # noqa: E731
    lines = [
        *_header(command, at, outcomes, seconds, split),
        "## Bars (test split)",
        "",
        "| bar | shipped defaults | tuned |", "|---|---|---|",
        *[f"| {name} | {yes(checks['shipped'][name])} | {yes(ok)} |" for name, ok in checks["tuned"].items()],
        f"| in-process and Prometheus verdicts equal ({agreement.get('runs', 0)} runs, "
        f"{agreement.get('steps', 0)} steps each with a step every {agreement.get('step_seconds', '-')} s; "
        f"tuned) | - | {yes(agreement['ok']) if agreement else 'not run'} |",
        "",
        "## Bars per test seed (tuned thresholds)",
        "",
        *_per_seed(outcomes),
        "",
        "## Summary (test split)",
        "",
        "| measure | shipped defaults | tuned |", "|---|---|---|",
        *[f"| {k} | {summaries['shipped'][k]} | {v} |" for k, v in summaries["tuned"].items()],
        "",
        "## Per alert (test split, tuned thresholds): firings on healthy runs, recall and lead on the runs "
        "that collapsed, firings on the other kinds of run, flaps per run",
        "",
        *_table([{"alert": name, **row} for name, row in alerts.items()]),
        "",
        "## Tuning (tuning split), candidates in the order tried",
        "",
        TUNING_RULE,
        "",
        *_table(tried),
        "",
        "## Scale-free trial: k3 / mean token entropy (not shipped)",
        "",
        SCALE_FREE,
        "",
        "Tuning split:", "", *_table(ratio["tuning"]), "", "Test split:", "", *_table(ratio["test"]),
        "",
        "## Runs (test split, tuned thresholds)",
        "",
        *_runs(outcomes),
    ]
    return "\n".join(lines) + "\n"


def _runs(outcomes: list[Outcome]) -> list[str]:
    lines = ["| run | kind | collapse step | first critical (step) | lead | critical alerts | warnings | flaps |",
             "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        first = o.first_critical
        crit = sorted({_short(e.name) for e in o.firings("critical")})
        warn = sorted({_short(e.name) for e in o.firings("warning")})
        lines.append(f"| {o.run} | {o.kind} | {o.collapse_step if o.collapse_step is not None else '-'} | "
                     f"{_short(first.name) + f' ({first.step})' if first else '-'} | "
                     f"{o.lead if o.lead is not None else '-'} | {', '.join(crit) or '-'} | "
                     f"{', '.join(warn) or '-'} | {o.flaps} |" + (f" error: {o.error}" if o.error else ""))
    return lines


def _header(command: str, at: dict[str, dict], outcomes: list[Outcome], seconds: float, split: dict) -> list[str]:
    fams = ", ".join(f"`{name}` ({FAMILIES[name]['policy']} on {FAMILIES[name]['tasks']})"
                     for name in split["families"])
    return [
        "<!-- Written by `python -m evaluation.acceptance`. -->",
        "# Alert acceptance report",
        "",
        f"Command: `{command}` ({seconds:.0f} s of replay; the traces were trained once by "
        "`python -m evaluation.matrix`).",
        "",
        f"Matrix: {len(split['scenarios'])} scenarios ({', '.join(split['scenarios'])}) x {len(split['families'])} "
        f"families ({fams}) x seeds: {split['tuning_runs']} tuning runs (seeds {list(split['tuning_seeds'])}), "
        f"{len(outcomes)} test runs (seeds {list(split['test_seeds'])}); staleness bound {STALENESS_BOUND}; kinds "
        "of run as in `evaluation.matrix.SCENARIOS`.",
        "",
        "Two sets of thresholds, each labelled in every table: **shipped defaults** (the catalogue's, what a run "
        f"gets without overrides: {_thresholds_text(at['shipped'])}) and **tuned** (chosen on the tuning split "
        f"for these toy policies: {_thresholds_text(at['tuned'])}; also "
        + ", ".join(f"`{k}`={v:g}" for k, v in at["tuned"].items() if k not in TUNED_PARAMS) + ").",
        "",
    ]


def _per_seed(outcomes: list[Outcome]) -> list[str]:
    rows = []
    for seed in sorted({o.seed for o in outcomes}):
        s = score([o for o in outcomes if o.seed == seed])
        rows.append({"seed": seed, "healthy pages": s["healthy_critical_pages"], "flaps": s["flaps"],
                     "collapses paged before": f"{s['collapsed_paged_before']}/{s['collapsed']}",
                     "intermittent": f"{s['intermittent_ok']}/{s['intermittent_runs']}",
                     "semantic": f"{s['semantic_ok']}/{s['semantic_runs']}",
                     "hack (took hold: buggy env only)": f"{s['hack_buggy_env_only']}/{s['hack_took_hold']}",
                     "every bar": "yes" if all(bars(s).values()) else "**no**"})
    return _table(rows)


def _short(name: str) -> str:
    return name.removeprefix("RLWatch")


__all__ = ["markdown"]
