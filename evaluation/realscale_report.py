"""The real-scale world of the acceptance report: its Markdown section and the JSON it adds.

:func:`run` evaluates the real-scale family's test split (:mod:`evaluation.realscale_eval`) at the
shipped defaults, replays a sample through Prometheus' rule engine at 10 s scrapes, and returns the
section that heads ``alerts/acceptance.md``.
"""

from __future__ import annotations

import time
from typing import Callable

from .realscale import CI_SAMPLE, TEST, TUNING
from .realscale_eval import evaluate

#: Marks the start of the toy world's part of alerts/acceptance.md.
TOY_MARKER = "<!-- toy world -->"


def run(cache: str | None, jobs: int = 1, prometheus_runs: int = 3,
        prometheus_agrees: Callable[..., dict] | None = None) -> tuple[str, dict]:
    """The real-scale section (Markdown) and its JSON, at the shipped defaults on the test split;
    ``prometheus_agrees`` (:func:`.acceptance.prometheus_agrees`) replays ``prometheus_runs`` of them
    through promtool."""
    started = time.perf_counter()
    result = evaluate("test", {}, cache, jobs)
    traces = result.pop("traces")
    sample = [t for t in traces if t["spec"].shape.name in CI_SAMPLE][:prometheus_runs]
    agreement = (prometheus_agrees(sample, {}, step_seconds=10, scrape=5)
                 if prometheus_runs and prometheus_agrees else {})
    result["prometheus_agreement"] = agreement
    result["seconds"] = round(time.perf_counter() - started)
    return markdown(result), result


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def markdown(result: dict) -> str:
    s, bars, agreement = result["summary"], result["bars"], result.get("prometheus_agreement") or {}
    lines = [
        "## Real scale (headline): language-model magnitudes, shipped defaults",
        "",
        "Synthetic runs whose token-level log-prob pairs follow published magnitudes (docs/real-scale.md: bf16 "
        "k3 ~1e-3 flat, fp16 ~1e-5, fp8 and MoE baselines with ESS ~0.94-0.98, slow healthy drift, isolated "
        "spikes, partial recoveries; collapses fast, slow, by a weight-sync step and by a sampler engine "
        "regression), replayed through `rlwatch.Watch` (`evaluation.realscale`). Thresholds: **shipped "
        "defaults** (no override). Test split: "
        f"{len(TEST)} shapes x seeds 10, 11 ({s['runs']} runs), none of whose baselines or growth rates are in "
        f"the tuning split ({len(TUNING)} shapes x seeds 0, 1).",
        "",
        f"Command: `python -m evaluation.acceptance --worlds real --out alerts/acceptance` "
        f"({result.get('seconds', '?')} s, traces cached in .rlwatch-realscale).",
        "",
        "| bar (real-scale test split, shipped defaults) | figure | met |",
        "|---|---|---|",
        f"| 0 critical pages on healthy runs | {s['healthy_critical_pages']} on {s['healthy_runs']} runs | "
        f"{'yes' if bars['0 critical pages on healthy runs'] else '**no**'} |",
        f"| every collapse paged before it | {s['collapsed_paged_before']}/{s['collapse_runs']} | "
        f"{'yes' if bars['every collapse paged before it'] else '**no**'} |",
        f"| lead fraction median >= 0.7 (of departure-to-collapse) | {_cell(s['lead_fraction_median'])} | "
        f"{'yes' if bars['lead fraction median >= 0.7'] else '**no**'} |",
        f"| lead fraction min >= 0.5 | {_cell(s['lead_fraction_min'])} | "
        f"{'yes' if bars['lead fraction min >= 0.5'] else '**no**'} |",
        f"| mismatch warnings (drift, jump) <= 0.1 per healthy 600-step run | "
        f"{s['mismatch_warnings_per_healthy_run']} ({s['healthy_mismatch_warnings']} on {s['healthy_runs']} runs) | "
        f"{'yes' if bars['mismatch warnings <= 0.1 per healthy 600-step run'] else '**no**'} |",
        f"| slow collapses: first mismatch warning within the first quarter | latest at "
        f"{_cell(s['slow_first_warning_fraction_max'])} of the time ({s['slow_warned']}/{s['slow_collapses']} "
        f"warned) | {'yes' if bars['slow collapses: first mismatch warning within the first quarter'] else '**no**'} |",
    ]
    if agreement:
        lines.append(f"| in-process and Prometheus verdicts equal ({agreement['runs']} runs, {agreement['steps']} "
                     f"steps, a step every 10 s, 5 s scrapes) | {'equal' if agreement['ok'] else 'differ'} | "
                     f"{'yes' if agreement['ok'] else '**no**'} |")
    lines += ["", "Lead fraction: (collapse - first critical page) / (collapse - departure); above 1 the page came "
              "before k3 passed 10x its baseline for good. Negative warning fraction: before the departure.",
              "", "### Per-alert precision (real-scale test split, shipped defaults)", "",
              "| alert | severity | firings on healthy runs | on collapse runs | precision |", "|---|---|---|---|---|"]
    for name, row in result["precision"].items():
        lines.append(f"| {name} | {row['severity']} | {row['healthy']} | {row['faulty']} | {row['precision']} |")
    lines += ["", "Precision: the share of an alert's firings that came on faulty (collapse) runs; - when it never "
              "fired.", "",
              "### Collapse runs", "", "| run | departure | collapse | first critical | lead fraction | first "
              "mismatch warning (fraction) |", "|---|---|---|---|---|---|"]
    for row in result["runs"]:
        if row["kind"] == "collapse":
            fraction = None if row["lead_fraction"] is None else round(row["lead_fraction"], 2)
            warned = None if row["first_mismatch_warning"] is None else round(row["first_mismatch_warning"], 2)
            lines.append(f"| {row['run']} | {row['depart']} | {row['collapse']} | {_cell(row['first_critical'])} | "
                         f"{_cell(fraction)} | {_cell(warned)} |")
    return "\n".join(lines) + "\n"


__all__ = ["TOY_MARKER", "markdown", "run"]
