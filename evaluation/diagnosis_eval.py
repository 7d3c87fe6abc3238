"""The diagnosis' labelled evaluation: known faults trained with rlwatch attached, diagnosed, scored.

Each scenario injects one cause (or none, or two) into the demo's training runs (:mod:`.scenario`),
over both policy families of the acceptance matrix (:data:`evaluation.matrix.FAMILIES`) and several
seeds; the runs are trained and cached by the matrix' own builder (:func:`evaluation.matrix.collect`).
Every threshold of :func:`rlwatch.analyses.diagnosis.decide` and the confidence calibration are chosen on the
tuning seeds (``--tune`` writes :mod:`rlwatch.analyses.diagnosis_tuned`); the confusion matrix is reported on
the test seeds, which the tuning never sees.

    python -m evaluation.diagnosis_eval --tune      # train (cached), tune, write the report
    python -m evaluation.diagnosis_eval --check     # the committed report matches the code

A verdict is right when the set of causes named equals the scenario's (a mixture must name both).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rlwatch.analyses import diagnosis
from .matrix import FAMILIES, RunSpec, collect

#: Every run of the evaluation: shorter and half the prompts of the matrix' runs (the diagnosis reads
#: the first steps; the runtime stays within minutes on two cores).
SETTINGS = {"steps": 10, "prompts_per_step": 16, "eval_every": 5}
#: name -> (the causes it injects, the scenario settings).
SCENARIOS: dict[str, tuple[tuple[str, ...], dict]] = {
    "on_policy_clean": (("none",), {}),
    "bf16_lag0": (("numeric_noise",), {"sampler_precision": "bf16"}),
    "fp8_lag0": (("numeric_noise",), {"sampler_precision": "fp8"}),
    "lag2": (("stale_weights",), {"lag": 2}),
    "lag4_tis": (("stale_weights",), {"lag": 4, "correction": "tis"}),
    "lag_varying": (("stale_weights",), {"lag": 4, "lag_jitter": True}),
    "partial_lag1": (("stale_weights",), {"lag": 1, "partial_rollouts": True}),
    "sync_missing": (("weight_sync_missing",), {"sync_stops_at": 2}),
    "temperature": (("temperature_mismatch",), {"sampler_temperature": 0.7}),
    "top_p": (("top_p_truncation",), {"sampler_top_p": 0.9}),
    "bf16_lag4": (("numeric_noise", "stale_weights"), {"sampler_precision": "bf16", "lag": 4}),
    "fp8_lag1": (("numeric_noise", "stale_weights"), {"sampler_precision": "fp8", "lag": 1}),
}
TUNING_SEEDS = (0, 1)
TEST_SEEDS = (3, 4, 5)
STALENESS_BOUND = 2.0            # the matrix' Watch (evaluation.matrix.collect)
#: Candidates of every threshold; the tuning picks the middle of the best ones.
GRID: dict[str, tuple[float, ...]] = {
    "floor": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3),
    "stale_excess": (0.003, 0.01, 0.03, 0.1),
    "temperature_slope": (0.05, 0.1, 0.2),
    "top_p_one_signed": (0.6, 0.8, 0.9),
    "sync_growth": (0.5, 0.7, 0.9),
    "sync_lag_min": (3.0, 4.0, 6.0),
}
REPORT = Path(__file__).resolve().parents[1] / "docs" / "diagnosis-evaluation.md"
TUNED_MODULE = Path(__file__).resolve().parents[1] / "rlwatch" / "analyses" / "diagnosis_tuned.py"
COMMAND = "python -m evaluation.diagnosis_eval --tune"


@dataclass(frozen=True)
class EvalRun(RunSpec):
    """One run of the evaluation: a :class:`RunSpec` whose scenario is one of :data:`SCENARIOS`."""

    @property
    def truth(self) -> tuple[str, ...]:
        return tuple(sorted(SCENARIOS[self.scenario][0]))

    @property
    def kind(self) -> str:
        return " + ".join(self.truth)

    @property
    def name(self) -> str:
        return f"diagnosis-{self.family}-{self.scenario}-{self.seed}"

    def config(self):
        from rlwatch.demo.scenario import ScenarioConfig

        overrides = {**FAMILIES[self.family], **SETTINGS, **SCENARIOS[self.scenario][1]}
        return replace(ScenarioConfig(), seed=self.seed, threads=1, **overrides)


def runs(seeds: tuple[int, ...], scenarios: tuple[str, ...] = tuple(SCENARIOS),
         families: tuple[str, ...] = tuple(FAMILIES)) -> list[EvalRun]:
    return [EvalRun(f, s, seed, SETTINGS["steps"]) for seed in seeds for f in families for s in scenarios]


def collect_runs(specs: list[EvalRun], cache: str, jobs: int) -> list[dict]:
    """Train (or read from ``cache``) every run with the matrix' builder; one worker takes all the
    scenarios of a family and seed, so each warm start is trained once."""
    if jobs <= 1:
        return [collect(s, cache) for s in specs]
    import concurrent.futures

    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(collect, specs, [cache] * len(specs), chunksize=len(SCENARIOS)))


def run_features(traces: list[dict]) -> list[tuple[EvalRun, dict]]:
    return [(t["spec"], diagnosis.features([v for _, v in t["steps"]], STALENESS_BOUND)) for t in traces]


def accuracy(rows: list[tuple[EvalRun, dict]], thresholds: dict[str, float]) -> float:
    right = sum(tuple(sorted(diagnosis.decide(f, thresholds)[0])) == spec.truth for spec, f in rows)
    return right / len(rows) if rows else 0.0


def tune(rows: list[tuple[EvalRun, dict]]) -> tuple[dict[str, float], float]:
    """The thresholds with the best tuning accuracy: each one the middle candidate among the best
    combinations (away from the edges of the region that scores best), checked to score best too."""
    names = list(GRID)
    scored = [(accuracy(rows, dict(zip(names, combo))), combo) for combo in itertools.product(*GRID.values())]
    best = max(a for a, _ in scored)
    winners = [combo for a, combo in scored if a == best]
    middle = tuple(statistics.median_low([c[i] for c in winners]) for i in range(len(names)))
    chosen = middle if middle in winners else winners[len(winners) // 2]
    return dict(zip(names, chosen)), best


def calibrate(rows: list[tuple[EvalRun, dict]], thresholds: dict[str, float]) -> dict[str, dict[int, float]]:
    """Tuning accuracy of each verdict (causes, margin bin), with one pseudo-count each way."""
    counts: dict[str, dict[int, list[int]]] = {}
    for spec, f in rows:
        causes, margin = diagnosis.decide(f, thresholds)
        key = " + ".join(sorted(causes))
        bin_index = sum(margin >= edge for edge in diagnosis.MARGIN_BINS)
        cell = counts.setdefault(key, {}).setdefault(bin_index, [0, 0])
        cell[0] += tuple(sorted(causes)) == spec.truth
        cell[1] += 1
    return {key: {b: round((right + 1) / (n + 2), 3) for b, (right, n) in sorted(bins.items())}
            for key, bins in sorted(counts.items())}


def verdict_rows(rows: list[tuple[EvalRun, dict]]) -> list[dict]:
    """Per run: its truth, the verdict of the shipped thresholds and its confidence."""
    out = []
    for spec, f in rows:
        causes, margin = diagnosis.decide(f)
        label, _ = diagnosis.confidence(causes, margin)
        out.append({"run": spec.name, "truth": spec.kind, "verdict": " + ".join(sorted(causes)),
                    "confidence": label, "right": tuple(sorted(causes)) == spec.truth})
    return out


def confusion(verdicts: list[dict]) -> tuple[list[str], dict[tuple[str, str], int]]:
    labels = sorted({v["truth"] for v in verdicts} | {v["verdict"] for v in verdicts})
    counts: dict[tuple[str, str], int] = {}
    for v in verdicts:
        counts[(v["truth"], v["verdict"])] = counts.get((v["truth"], v["verdict"]), 0) + 1
    return labels, counts


def render_report(tuning: list[dict], test: list[dict], tuning_best: float) -> str:
    labels, counts = confusion(test)
    right = sum(v["right"] for v in test)
    clean_named = sum(v["verdict"] != "none" for v in test if v["truth"] == "none")
    lines = ["# Diagnosis evaluation", "",
             f"Made by `{COMMAND}` (runs cached under `.rlwatch-matrix`); `python -m evaluation.diagnosis_eval "
             "--check` verifies this file against the code. Module: `evaluation/diagnosis_eval.py`.", "",
             f"Scenarios ({len(SCENARIOS)}) x families ({', '.join(FAMILIES)}) x seeds: tuning "
             f"{', '.join(map(str, TUNING_SEEDS))}, test {', '.join(map(str, TEST_SEEDS))}; "
             f"{SETTINGS['steps']} steps of {SETTINGS['prompts_per_step']} prompts per run, staleness bound "
             f"{STALENESS_BOUND:g}. A verdict is right when it names exactly the injected causes.", "",
             "| scenario | injected |", "|---|---|"]
    lines += [f"| {name} | {' + '.join(causes)} ({', '.join(f'{k}={v}' for k, v in settings.items()) or 'as is'}) |"
              for name, (causes, settings) in SCENARIOS.items()]
    lines += ["", f"Thresholds chosen on the tuning seeds (their accuracy {tuning_best:.1%}): "
              + ", ".join(f"`{k}` {v:g}" for k, v in diagnosis.THRESHOLDS.items()) + ".", "",
              f"## Test split: {right}/{len(test)} right ({right / len(test):.1%}); cause named on "
              f"{clean_named} of {sum(v['truth'] == 'none' for v in test)} clean runs", "",
              "Rows: injected; columns: diagnosed.", "",
              "| injected \\ diagnosed | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    lines += [f"| {t} | " + " | ".join(str(counts.get((t, d), 0) or ".") for d in labels) + " |"
              for t in labels if any(counts.get((t, d)) for d in labels)]
    tuning_right = sum(v["right"] for v in tuning)
    by_label = {label: [v["right"] for v in test if v["confidence"] == label] for label in ("high", "medium", "low")}
    lines += ["", f"Tuning seeds with the same thresholds: {tuning_right}/{len(tuning)} right.", "",
              "Confidence (the tuning seeds' accuracy on verdicts of the same causes and margin bin) against "
              "the test seeds: " + "; ".join(f"{label}: {sum(r)}/{len(r)} right" for label, r in by_label.items()
                                               if r) + ".", "",
              "How the verdict is reached (rlwatch/analyses/diagnosis.py): a missing weight sync where the maximum lag "
              "still grows about one per update over the last third of the window; none below the floor of "
              "mean |log-ratio|; where no staleness is measured, a temperature fault from the slope of the "
              "log-ratio on the sampler log-prob, a top-p fault from a one-signed offset; otherwise the per-lag "
              "mismatch: its lag-0 level above the floor is numeric noise, its excess above that level at older "
              "lags is staleness, both named where both are present, the larger share of the mean first.", "",
              "## Test runs", "", "| run | injected | diagnosed | confidence |", "|---|---|---|---|"]
    lines += [f"| {v['run']} | {v['truth']} | {v['verdict']}{'' if v['right'] else ' (wrong)'} | "
              f"{v['confidence']} |" for v in test]
    return "\n".join(lines) + "\n"


def render_tuned(thresholds: dict[str, float], calibration: dict[str, dict[int, float]]) -> str:
    cal = ",\n".join(f"    {k!r}: {v!r}" for k, v in calibration.items())
    thr = ",\n".join(f"    {k!r}: {v!r}" for k, v in thresholds.items())
    return (f'"""The diagnosis\' thresholds and confidence calibration, chosen on the tuning split of the labelled\n'
            f'evaluation. Generated by ``{COMMAND}``: do not edit by hand."""\n\n'
            f"#: Thresholds of :func:`rlwatch.analyses.diagnosis.decide` (nats, slopes, fractions, updates).\n"
            f"THRESHOLDS: dict[str, float] = {{\n{thr},\n}}\n\n"
            f"#: Tuning-split accuracy of verdicts by causes (sorted, joined by \" + \") and margin bin.\n"
            f"CALIBRATION: dict[str, dict[int, float]] = {{\n{cal},\n}}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Evaluate the mismatch diagnosis on labelled runs.")
    parser.add_argument("--cache", default=".rlwatch-matrix")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tune", action="store_true", help=f"choose the thresholds and write {TUNED_MODULE.name}")
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed report differs")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tuning = run_features(collect_runs(runs(TUNING_SEEDS), args.cache, args.jobs))
    test = run_features(collect_runs(runs(TEST_SEEDS), args.cache, args.jobs))
    thresholds, best = tune(tuning)
    if args.tune:
        calibration = calibrate(tuning, thresholds)
        TUNED_MODULE.write_text(render_tuned(thresholds, calibration))
        diagnosis.THRESHOLDS.clear()                 # the module's own dicts: the report below uses them
        diagnosis.THRESHOLDS.update(thresholds)
        diagnosis.CALIBRATION.clear()
        diagnosis.CALIBRATION.update(calibration)
    elif thresholds != diagnosis.THRESHOLDS:
        print(f"the tuning now chooses {thresholds}, the code has {diagnosis.THRESHOLDS}: rerun with --tune")
        return 1
    text = render_report(verdict_rows(tuning), verdict_rows(test), best)
    if args.check:
        same = REPORT.exists() and REPORT.read_text() == text
        print("report up to date" if same else f"{REPORT} differs from what the code gives: rerun {COMMAND}")
        return 0 if same else 1
    REPORT.write_text(text)
    print(text.split("## Test runs")[0])
    print(f"{len(tuning) + len(test)} runs in {time.perf_counter() - started:.0f} s; wrote {REPORT}")
    return 0


if __name__ == "__main__":
    from . import diagnosis_eval      # the importable module: cached runs then name its EvalRun

    raise SystemExit(diagnosis_eval.main())
