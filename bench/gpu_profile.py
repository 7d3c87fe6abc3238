"""Where one compute_step's time goes on a GPU: the record build against the step, and the top
operations by self device time and by self host time (torch.profiler), eager and compiled.

    python bench/gpu_profile.py [--B 512 --T 2048] [--top 15] [--cpu]

A companion of bench/gpu_check.py (which checks correctness, prints the speed table and ends with these
tables at 1M tokens): this one says why a size is slow. Also prints the kernel-launching operations
one eager step dispatches by the accelerator plan, counted on the host (bench/_dispatch.py).
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


def profile_step(B: int, T: int, device: str, top: int = 15) -> None:
    """Record build and compute_step medians and torch.profiler's top operations of one B x T step on
    ``device``, eager then compiled; and the accelerator plan's dispatched operations."""
    from bench._dispatch import count_step

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    ops = count_step(make_inputs(B, T), "accelerator")
    print(f"== {B}x{T}: the eager accelerator plan dispatches {sum(ops.values())} kernel-launching operations "
          f"(counted on the host): {', '.join(f'{n} {k}' for k, n in ops.most_common(8))}, ...")
    inputs = to_device(make_inputs(B, T), device)
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
        print(f"== {B}x{T} {device} {'compiled' if mode == 'always' else 'eager'}: "
              f"record build {build_ms:.2f} ms, compute_step {step_ms:.2f} ms, compiled steps {ws.compiled_steps}")
        with profile(activities=activities) as prof:
            signals.compute_step(record, config, ws)
            sync()
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))
        if device == "cuda":
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                            max_name_column_width=60))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--B", type=int, default=512)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dry-run-on-cpu", "--cpu", action="store_true")
    args = parser.parse_args()
    profile_step(args.B, args.T, "cpu" if args.dry_run_on_cpu else "cuda", args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
