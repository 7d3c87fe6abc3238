"""The engine's CPU thread policy, measured: one eager ``compute_step`` on one intra-op thread against
every thread of the host, alternating in one process (the host's neighbours weigh on both alike).

    python bench/bench_threads.py [--sizes 8x64,64x512,512x2048] [--rounds 10] [--steps 3]

Prints, per size, the median wall time per step (ms) with ``settings.CPU_THREADS`` = 1 and = the
host's thread count, and their ratio; the figures behind ``rlwatch.signals.settings.CPU_THREADS``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.bench_signals import make_inputs  # noqa: E402
from rlwatch import signals  # noqa: E402
from rlwatch.core.errors import HookErrors  # noqa: E402
from rlwatch.core.record import RecordBuilder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8x64,64x512,512x2048", help="BxT, comma separated")
    parser.add_argument("--rounds", type=int, default=10, help="alternations (each setting once per round)")
    parser.add_argument("--steps", type=int, default=3, help="steps per setting per round")
    args = parser.parse_args()
    every = torch.get_num_threads()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {every} intra-op threads by default; "
          f"{args.rounds} alternating rounds of {args.steps} steps (wall-time medians, ms per step)")
    for size in args.sizes.split(","):
        B, T = (int(x) for x in size.split("x"))
        inputs = make_inputs(B, T)
        ws = signals.Workspace(compile="never")
        builder, config = RecordBuilder(HookErrors(strict=True)), signals.SignalConfig()
        record = builder.build(0, inputs, ws)
        times: dict[int, list[float]] = {1: [], every: []}
        for r in range(args.rounds + 1):
            for threads in ((1, every) if r % 2 == 0 else (every, 1)):
                signals.settings.CPU_THREADS = threads
                started = time.perf_counter()
                for _ in range(args.steps):
                    signals.compute_step(record, config, ws)
                if r:                                   # round 0 warms the caches and buffers
                    times[threads].append((time.perf_counter() - started) / args.steps * 1e3)
        one, many = statistics.median(times[1]), statistics.median(times[every])
        print(f"  {B}x{T}: 1 thread {one:.2f} ms, {every} threads {many:.2f} ms, ratio 1/{every} = {one / many:.2f}")


if __name__ == "__main__":
    main()
