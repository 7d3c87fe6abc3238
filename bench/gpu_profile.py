"""Where one compute_step's time goes on a GPU: the record build against the step, and the top
operations by self device time and by self host time (torch.profiler), eager and compiled.

    python bench/gpu_profile.py [--B 512 --T 2048] [--top 15] [--dry-run-on-cpu]

A companion of bench/gpu_check.py (which checks correctness and prints the speed table): this one
says why a size is slow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.bench_signals import make_inputs, to_device  # noqa: E402
from rlwatch import signals  # noqa: E402
from rlwatch.core.errors import HookErrors  # noqa: E402
from rlwatch.core.record import RecordBuilder  # noqa: E402
from rlwatch.signals import engine  # noqa: E402


def median_ms(fn, sync, rounds: int = 20) -> float:
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--B", type=int, default=512)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dry-run-on-cpu", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.dry_run_on_cpu else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    inputs = to_device(make_inputs(args.B, args.T), device)
    for mode in ("never", "always"):
        ws = signals.Workspace(compile=mode)
        builder, config = RecordBuilder(HookErrors(strict=True)), signals.SignalConfig()
        record = builder.build(0, inputs, ws)
        signals.compute_step(record, config, ws)
        if mode == "always":
            engine.wait()
        signals.compute_step(builder.build(0, inputs, ws), config, ws)
        build_ms = median_ms(lambda: builder.build(0, inputs, ws), sync)
        step_ms = median_ms(lambda: signals.compute_step(record, config, ws), sync)
        print(f"== {args.B}x{args.T} {device} {'compiled' if mode == 'always' else 'eager'}: "
              f"record build {build_ms:.2f} ms, compute_step {step_ms:.2f} ms, compiled steps {ws.compiled_steps}")
        with profile(activities=activities) as prof:
            signals.compute_step(record, config, ws)
            sync()
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))
        if device == "cuda":
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                            max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
