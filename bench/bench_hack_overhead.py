"""What the reward-hack detectors add to the step time of the scenario's hack run.

The same seeds run with and without episodes handed to the built-in detectors (every other
rlwatch part on in both), interleaved run by run; the step time is the wall time between two
consecutive steps of the training loop. Prints the median step time of each and the ratio.

    python bench/bench_hack_overhead.py [--seeds 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlwatch  # noqa: E402
from rlwatch.demo import WATCH_CONFIG  # noqa: E402
from rlwatch.demo.scenario import SCENARIOS, run_scenario  # noqa: E402


def step_times(seed: int, steps: int, detectors: bool) -> list[float]:
    config = replace(SCENARIOS["hack"], seed=seed, steps=steps)
    times: list[float] = []
    last = [time.perf_counter()]
    with tempfile.TemporaryDirectory() as directory, \
            rlwatch.Watch(run="bench", port=0, store=f"{directory}/s.db",
                          hack_detectors=None if detectors else False, **WATCH_CONFIG) as watch:
        def on_step(info) -> None:
            watch.observe(info.step, **info.fields, episodes=info.episodes)
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now
        run_scenario(config, on_step=on_step)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    on, off, ratios = [], [], []
    for seed in range(args.seeds):
        # A B B A per seed, so that a drift of the machine's speed cancels within the pair.
        a1 = step_times(seed, args.steps, detectors=False)
        b1 = step_times(seed, args.steps, detectors=True)
        b2 = step_times(seed, args.steps, detectors=True)
        a2 = step_times(seed, args.steps, detectors=False)
        off += a1 + a2
        on += b1 + b2
        ratios.append(statistics.median(b1 + b2) / statistics.median(a1 + a2))
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"hack scenario, {args.seeds} seeds x {args.steps} steps (ABBA per seed), 256 episodes per step, "
          f"built-in detectors")
    print(f"  median step time without detectors {m_off * 1e3:.1f} ms, with {m_on * 1e3:.1f} ms; per-seed ratios "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; median +{(statistics.median(ratios) - 1) * 100:.1f}% "
          f"(bar <= 5%)")


if __name__ == "__main__":
    main()
