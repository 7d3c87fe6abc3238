"""The alert acceptance suite: does rlwatch page before a collapse, and only then?

Runs the scenario engine with rlwatch attached (in-process alert evaluator, run store, built-in
hack detectors) for several seeds per scenario and prints one table: per run, the step at which
the held-out true reward collapsed (below half its running peak for the rest of the run), the
first critical alert and its lead in steps, the critical alerts in runs that did not collapse
(false alarms), and which environments a hack-rate alert named.

    python -m rlwatch.demo.acceptance [--seeds 5] [--jobs 2]

Acceptance: every collapsing run gets a critical alert before its collapse step; no critical alert
in a healthy run (lag 0, lag 2); the hack scenario's hack-rate alert names the buggy environment
only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

SUITE = ("healthy", "lag2", "collapse", "rescued", "hack")
HEALTHY = ("healthy", "lag2")
BUGGY_ENV = "reverse"


@dataclass
class Outcome:
    scenario: str
    seed: int
    collapse_step: int | None
    first_critical: str | None = None
    first_critical_step: int | None = None
    critical_alerts: list[str] = field(default_factory=list)
    hack_envs: list[str] = field(default_factory=list)
    final_heldout: float | None = None
    seconds: float = 0.0

    @property
    def lead(self) -> int | None:
        if self.collapse_step is None or self.first_critical_step is None:
            return None
        return self.collapse_step - self.first_critical_step

    @property
    def paged_in_time(self) -> bool:
        return self.lead is not None and self.lead > 0


def run_one(scenario: str, seed: int, steps: int | None = None) -> Outcome:
    import torch

    from .. import Watch
    from . import WATCH_CONFIG
    from .scenario import SCENARIOS, collapse_step, run_scenario

    torch.set_num_threads(1)
    config = replace(SCENARIOS[scenario], seed=seed, threads=1, **({"steps": steps} if steps else {}))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        watch = Watch(run=f"{scenario}-{seed}", port=None, store=f"{directory}/run.db", **WATCH_CONFIG)

        def on_step(info) -> None:
            extra = {"episodes": info.episodes} if scenario == "hack" else {}
            watch.observe(info.step, **info.fields, **extra)
            watch.log_scalars(info.step, info.metrics)

        result = run_scenario(config, on_step=on_step)
        if watch.hacks is not None:
            watch.hacks.flush()
            watch.observe(config.steps, mask=torch.ones(1, 1))      # carries the last verdicts
        events = list(watch.evaluator.events) if watch.evaluator else []
        watch.close()
    collapse = collapse_step(result.heldout)
    critical = [e for e in events if e.state == "firing" and e.severity == "critical"]
    first = min(critical, key=lambda e: e.step) if critical else None
    hack_envs = sorted({e.labels.get("env", "") for e in critical if e.name == "RLWatchRewardHackRateRising"})
    return Outcome(scenario=scenario, seed=seed, collapse_step=collapse,
                   first_critical=first.name if first else None, first_critical_step=first.step if first else None,
                   critical_alerts=sorted({e.name for e in critical}), hack_envs=hack_envs,
                   final_heldout=result.heldout[-1][1] if result.heldout else None,
                   seconds=time.perf_counter() - start)


def run_suite(seeds: int = 5, scenarios: tuple[str, ...] = SUITE, jobs: int = 2, steps: int | None = None
              ) -> list[Outcome]:
    tasks = [(s, seed) for s in scenarios for seed in range(seeds)]
    if jobs <= 1:
        return [run_one(s, seed, steps) for s, seed in tasks]
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run_one, *zip(*tasks), [steps] * len(tasks)))


def verdict(outcomes: list[Outcome]) -> dict[str, object]:
    collapsing = [o for o in outcomes if o.collapse_step is not None and o.scenario not in HEALTHY]
    healthy = [o for o in outcomes if o.scenario in HEALTHY]
    hack = [o for o in outcomes if o.scenario == "hack"]
    leads = [o.lead for o in collapsing if o.lead is not None]
    return {
        "collapsing_runs": len(collapsing),
        "paged_before_collapse": sum(o.paged_in_time for o in collapsing),
        "lead_min": min(leads) if leads else None,
        "lead_median": statistics.median(leads) if leads else None,
        "healthy_runs": len(healthy),
        "healthy_collapsed": sum(o.collapse_step is not None for o in healthy),
        "false_alarms": sum(bool(o.critical_alerts) for o in healthy),
        "hack_runs": len(hack),
        "hack_alert_buggy_env_only": sum(o.hack_envs == [BUGGY_ENV] for o in hack),
        "collapse_scenario_collapsed": sum(o.collapse_step is not None for o in outcomes if o.scenario == "collapse"),
        "collapse_scenario_runs": sum(o.scenario == "collapse" for o in outcomes),
    }


def accepted(v: dict[str, object]) -> bool:
    return (v["paged_before_collapse"] == v["collapsing_runs"] and v["false_alarms"] == 0
            and v["hack_alert_buggy_env_only"] == v["hack_runs"])


def table(outcomes: list[Outcome]) -> str:
    lines = ["| scenario | seed | collapse step | first critical alert (step) | lead (steps) | critical alerts | "
             "hack alert envs | final held-out | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        first = f"{o.first_critical} ({o.first_critical_step})" if o.first_critical else "-"
        final = f"{o.final_heldout:.2f}" if o.final_heldout is not None else "-"
        collapse = o.collapse_step if o.collapse_step is not None else "-"
        lead = o.lead if o.lead is not None else "-"
        lines.append(f"| {o.scenario} | {o.seed} | {collapse} | {first} | {lead} | "
                     f"{', '.join(o.critical_alerts) or '-'} | {', '.join(o.hack_envs) or '-'} | {final} | "
                     f"{o.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--scenarios", default=",".join(SUITE))
    parser.add_argument("--steps", type=int)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    outcomes = run_suite(args.seeds, tuple(args.scenarios.split(",")), args.jobs, args.steps)
    v = verdict(outcomes)
    if args.json:
        import json

        print(json.dumps({"outcomes": [asdict(o) | {"lead": o.lead} for o in outcomes], "verdict": v}, indent=2))
    else:
        print(table(outcomes))
        print()
        print(f"collapsing runs paged before the collapse: {v['paged_before_collapse']}/{v['collapsing_runs']} "
              f"(lead min {v['lead_min']}, median {v['lead_median']} steps); critical alerts in healthy runs: "
              f"{v['false_alarms']}/{v['healthy_runs']}; hack alert for '{BUGGY_ENV}' only: "
              f"{v['hack_alert_buggy_env_only']}/{v['hack_runs']}; {time.perf_counter() - started:.0f} s")
        print("ACCEPTED" if accepted(v) else "NOT ACCEPTED")
    return 0 if accepted(v) else 1


if __name__ == "__main__":
    raise SystemExit(main())
