"""Calibration of the demo scenarios: ``python -m evaluation.calibrate [--seeds N] [--workers W]``.

Runs every scenario in :data:`~rlwatch.demo.scenario.SCENARIOS` for several seeds and prints one
row per scenario: how many seeds collapsed (held-out true reward below half its running peak until
the end), when, the held-out start / peak / final values, the mean per-token
``|trainer_logp - sampler_logp|`` on masked tokens (over all steps, and signed at step 0), the
hacked fraction (training reward 1, true checker fails) per environment at the start and end, and
seconds per run. It then checks the acceptance criteria and exits non-zero if one fails.

Runs execute in ``--workers`` processes with one torch thread each (the default ``threads=1`` of
:class:`ScenarioConfig`, so the table describes exactly the runs a default demo makes); two timing
runs measure one standard scenario alone with one and with two threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from rlwatch.demo.scenario import ENV_NAMES, SCENARIOS, StepInfo, collapse_step, run_scenario

WINDOW = 5   # steps averaged for "final" held-out and start/end hacked shares


def run_one(name: str, seed: int, threads: int = 1) -> dict:
    """Run ``SCENARIOS[name]`` with ``seed`` and summarise it (a picklable dict)."""
    config = replace(SCENARIOS[name], seed=seed, threads=threads)
    abs_mismatch: list[float] = []
    signed0: list[float] = []
    hacked: list[dict[str, float]] = []

    def on_step(info: StepInfo) -> None:
        f = info.fields
        m = f["mask"].float()
        r = (f["trainer_logp"] - f["sampler_logp"]) * m
        n = m.sum().item()
        abs_mismatch.append(r.abs().sum().item() / n)
        if info.step == 0:
            signed0.append(r.sum().item() / n)
        per_env = {}
        for env in ENV_NAMES:
            eps = [e for e in info.episodes if e["env"] == env]
            per_env[env] = sum(e["reward"] >= 0.999 and not e["true_pass"] for e in eps) / max(1, len(eps))
        hacked.append(per_env)

    result = run_scenario(config, on_step=on_step)
    values = [v for _, v in result.heldout]
    return {
        "name": name, "seed": seed, "seconds": result.seconds, "steps": len(result.history),
        "collapse": collapse_step(result.heldout),
        "start": values[0], "peak": max(values),
        "final": statistics.mean(values[-WINDOW:]),
        "mismatch": statistics.mean(abs_mismatch), "mismatch0": abs_mismatch[0], "signed0": signed0[0],
        "hacked_start": {e: statistics.mean(h[e] for h in hacked[:WINDOW]) for e in ENV_NAMES},
        "hacked_end": {e: statistics.mean(h[e] for h in hacked[-WINDOW:]) for e in ENV_NAMES},
    }


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def summarise(rows: list[dict]) -> dict[str, dict]:
    """Per-scenario aggregates of :func:`run_one` rows."""
    out = {}
    for name in SCENARIOS:
        rs = sorted((r for r in rows if r["name"] == name), key=lambda r: r["seed"])
        if not rs:
            continue
        out[name] = {
            "n": len(rs), "collapsed": sum(r["collapse"] is not None for r in rs),
            "collapse_steps": [r["collapse"] for r in rs],
            "start": _mean([r["start"] for r in rs]), "peak": _mean([r["peak"] for r in rs]),
            "final": _mean([r["final"] for r in rs]), "finals": [r["final"] for r in rs],
            "peak_gain": [r["peak"] - r["start"] for r in rs],
            "mismatch": _mean([r["mismatch"] for r in rs]), "mismatch0": _mean([r["mismatch0"] for r in rs]),
            "signed0": _mean([r["signed0"] for r in rs]),
            "hacked_start": {e: _mean([r["hacked_start"][e] for r in rs]) for e in ENV_NAMES},
            "hacked_end": {e: _mean([r["hacked_end"][e] for r in rs]) for e in ENV_NAMES},
            "hacked_end_min": {e: min(r["hacked_end"][e] for r in rs) for e in ENV_NAMES},
            "seconds": _mean([r["seconds"] for r in rs]),
        }
    return out


def print_table(summary: dict[str, dict]) -> None:
    head = (f"{'scenario':<18}{'collapsed':>10}  {'collapse steps':<24}{'start':>6}{'peak':>6}{'final':>6}"
            f"  {'finals by seed':<31}{'|dlogp|':>8}{'|dlogp|@0':>10}{'dlogp@0':>9}"
            f"  {'hacked rev start>end':<21}{'hacked copy end':>16}{'s/run':>7}")
    print(head)
    print("-" * len(head))
    for name, s in summary.items():
        steps = ",".join("-" if c is None else str(c) for c in s["collapse_steps"])
        finals = " ".join(f"{f:.2f}" for f in s["finals"])
        hr = f"{s['hacked_start']['reverse']:.2f} > {s['hacked_end']['reverse']:.2f}"
        print(f"{name:<18}{s['collapsed']:>6}/{s['n']:<3}  {steps:<24}{s['start']:>6.2f}{s['peak']:>6.2f}"
              f"{s['final']:>6.2f}  {finals:<31}{s['mismatch']:>8.3f}{s['mismatch0']:>10.3f}{s['signed0']:>9.3f}"
              f"  {hr:<21}{s['hacked_end']['copy']:>16.2f}{s['seconds']:>7.1f}")


def check(summary: dict[str, dict]) -> list[tuple[str, bool]]:
    """The acceptance criteria as (description, passed)."""
    s = summary
    results: list[tuple[str, bool]] = []

    def add(text: str, ok: bool) -> None:
        results.append((text, bool(ok)))

    healthy = s["healthy"]["final"]
    for name in ("healthy", "lag2"):
        add(f"{name}: never collapses", s[name]["collapsed"] == 0)
    add("lag2: final held-out within 0.1 of healthy", abs(s["lag2"]["final"] - healthy) <= 0.1)
    add("collapse: collapses in every seed", s["collapse"]["collapsed"] == s["collapse"]["n"])
    add("collapse: every collapse at step >= 10",
        all(c is not None and c >= 10 for c in s["collapse"]["collapse_steps"]))
    add("collapse: learns first (peak - start >= 0.1 in every seed)", min(s["collapse"]["peak_gain"]) >= 0.1)
    add("rescued: no collapse in >= 4 of 5 seeds", s["rescued"]["n"] - s["rescued"]["collapsed"] >= 4)
    add("rescued: final clearly above collapse (by >= 0.2)", s["rescued"]["final"] - s["collapse"]["final"] >= 0.2)
    add("hack: hacked share of 'reverse' > 0.5 at the end in every seed", s["hack"]["hacked_end_min"]["reverse"] > 0.5)
    add("hack: hacked share of 'reverse' rises (end - start >= 0.3)",
        s["hack"]["hacked_end"]["reverse"] - s["hack"]["hacked_start"]["reverse"] >= 0.3)
    add("hack: 'copy' stays clean (hacked share < 0.02)", s["hack"]["hacked_end"]["copy"] < 0.02)
    add("mismatch: lag 0 ~ 0 (< 1e-4)", s["healthy"]["mismatch"] < 1e-4)
    add("mismatch: grows with lag (0 < lag2 < lag8)",
        s["healthy"]["mismatch"] < s["lag2"]["mismatch"] < s["collapse"]["mismatch"])
    for name in ("temperature_fault", "top_p_fault"):
        add(f"{name}: clear mismatch at step 0 (> 0.05)", s[name]["mismatch0"] > 0.05)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]

    t0 = time.perf_counter()
    for threads in (1, 2):
        timing = run_one("healthy", 0, threads=threads)
        print(f"timing: one standard run ('healthy', {timing['steps']} steps) alone with {threads} thread(s): "
              f"{timing['seconds']:.1f} s")
    jobs = [(n, seed) for n in names for seed in range(args.seeds)]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        rows = list(pool.map(run_one, *zip(*jobs)))
    summary = summarise(rows)
    print(f"\n{args.seeds} seeds per scenario, {args.workers} worker processes x 1 thread "
          f"(s/run is per run under that load); held-out = true pass rate on 128 fixed held-out prompts;\n"
          f"start = held-out after the first update (step 0), final = mean of the last {WINDOW} evaluations; "
          f"|dlogp| = mean over steps of |trainer_logp - sampler_logp| on masked tokens (nats); "
          f"dlogp@0 is signed, at step 0;\n"
          f"hacked = training reward 1 while the true checker fails (mean of the first/last {WINDOW} steps).\n")
    print_table(summary)
    print(f"\ntotal wall time: {time.perf_counter() - t0:.0f} s")
    if set(names) >= {"healthy", "lag2", "collapse", "rescued", "hack", "temperature_fault", "top_p_fault"}:
        results = check(summary)
        print("\nacceptance:")
        for text, ok in results:
            print(f"  [{'PASS' if ok else 'FAIL'}] {text}")
        return 0 if all(ok for _, ok in results) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
