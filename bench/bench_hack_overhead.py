"""What the reward-hack detectors add to the step time of the scenario's hack run.

The scenario trainer runs with every rlwatch part on; the episodes of one step in four are handed
to the built-in detectors (which judge them in rlwatch's child process while the trainer goes on),
the others are not. Paired 4-step cycles (``bench/_paired.py``) compare the judged step and the
next one with the two after them; the step time is the wall time between two consecutive steps
of the training loop. ``--whole-runs`` compares whole runs with and without detectors instead
(ABBA per seed), which the machine's drift between runs makes far noisier.

    python bench/bench_hack_overhead.py [--seeds 4] [--steps 84] [--whole-runs]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlwatch  # noqa: E402
from bench import _paired  # noqa: E402
from rlwatch.demo import WATCH_CONFIG  # noqa: E402
from rlwatch.demo.scenario import SCENARIOS, run_scenario  # noqa: E402

WARMUP_STEPS = 4


def step_times(seed: int, steps: int, judged: str) -> tuple[list[float], list[bool]]:
    """Wall time of each step after the warm-up, and whether the detectors had nothing left to do
    (every batch judged, every verdict collected) when the step began. ``judged``: "all", "none" or
    "cycles" (one step in four, see ``bench/_paired.py``)."""
    config = replace(SCENARIOS["hack"], seed=seed, steps=steps)
    times: list[float] = []
    idle = [True]
    last = [time.perf_counter()]
    with tempfile.TemporaryDirectory() as directory, \
            rlwatch.Watch(run="bench", port=0, store=f"{directory}/s.db",
                          hack_detectors=False if judged == "none" else None, **WATCH_CONFIG) as watch:
        def on_step(info) -> None:
            index = len(times)
            episodes = info.episodes if judged == "all" or judged == "cycles" and _paired.watched(index) else None
            watch.observe(info.step, **info.fields, episodes=episodes)
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now
            monitor = watch.hacks
            idle.append(monitor is None or monitor._submitted == monitor._done and not monitor._judged)
        run_scenario(config, on_step=on_step)
    return times[WARMUP_STEPS:], idle[WARMUP_STEPS:len(times)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=84)
    parser.add_argument("--whole-runs", action="store_true", help="whole runs with and without detectors, ABBA")
    args = parser.parse_args()
    logging.getLogger("rlwatch").setLevel(logging.ERROR)       # the scenario trips alerts; keep it quiet
    print(f"hack scenario, {args.seeds} seeds x {args.steps} steps, 256 episodes per step, built-in detectors")
    if not args.whole_runs:
        overheads: list[float] = []
        base: list[float] = []
        dropped = 0
        for seed in range(args.seeds):
            times, idle = step_times(seed, args.steps, "cycles")
            found = _paired.cycle_overheads(times, WARMUP_STEPS, idle)
            dropped += len(_paired.cycle_overheads(times, WARMUP_STEPS)) - len(found)
            overheads += found
            base += [t for i, t in enumerate(times) if (WARMUP_STEPS + i) % _paired.PERIOD >= 2]
            print(f"  seed {seed}: {_paired.describe(overheads)}", flush=True)
        print(f"  detectors' cost per judged step, paired 4-step cycles: {_paired.describe(overheads)} (bar <= 5%); "
              f"median baseline step {statistics.median(base) * 1e3:.1f} ms; {dropped} cycles dropped (detectors still "
              "busy when the baseline began)")
        return
    on, off, ratios = [], [], []
    for seed in range(args.seeds):
        # A B B A per seed, so that a drift of the machine's speed cancels within the pair.
        a1, _ = step_times(seed, args.steps, "none")
        b1, _ = step_times(seed, args.steps, "all")
        b2, _ = step_times(seed, args.steps, "all")
        a2, _ = step_times(seed, args.steps, "none")
        off += a1 + a2
        on += b1 + b2
        ratios.append(statistics.median(b1 + b2) / statistics.median(a1 + a2))
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"  whole runs (ABBA per seed): median step time without detectors {m_off * 1e3:.1f} ms, with "
          f"{m_on * 1e3:.1f} ms; per-seed ratios {', '.join(f'{r:.3f}' for r in ratios)}; median "
          f"{(statistics.median(ratios) - 1) * 100:+.1f}% (bar <= 5%)")


if __name__ == "__main__":
    main()
