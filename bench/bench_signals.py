"""One step of B=512, T=2048 (1M response tokens) on CPU: rlwatch's full signal set against verl's
own rollout-correction metrics, a memory-bound floor, and the per-token Histogram.observe loop.

Timings are interleaved round by round in one process and reported as medians, so the ratios
stay meaningful on a shared, noisy machine. Peak memory is measured in fresh subprocesses
(ru_maxrss growth over the inputs). Run:

    python bench/bench_signals.py [--rounds 15] [--B 512] [--T 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def make_inputs(B: int, T: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((B,), T)                      # 1M response tokens at B=512, T=2048
    lengths[: B // 8] = torch.randint(T // 4, T, (B // 8,), generator=g)   # a few end early
    mask = torch.arange(T)[None, :] < lengths[:, None]
    sampler = -torch.rand(B, T, generator=g) * 3
    trainer = sampler + 0.05 * torch.randn(B, T, generator=g)
    switch = torch.randint(0, T, (B, 1), generator=g)
    start = 100 - torch.randint(0, 6, (B, 1), generator=g)
    version = torch.where(torch.arange(T)[None] < switch, start, start + 1).clamp(max=100)   # partial rollouts
    return dict(mask=mask, sampler_logp=sampler, trainer_logp=trainer, token_version=version, trainer_version=100,
                rewards=torch.randint(0, 2, (B,), generator=g).float(), group_ids=torch.arange(B) // 8,
                truncated=lengths == T, env=["math", "code", "agent", "chat"] * (B // 4))


def rlwatch_runner(inputs: dict):
    from rlwatch.errors import HookErrors
    from rlwatch.record import RecordBuilder
    from rlwatch.signals import SignalConfig, Workspace, compute_step

    builder, ws, config = RecordBuilder(HookErrors(strict=True)), Workspace(), SignalConfig()

    def run() -> None:
        compute_step(builder.build(0, inputs, ws), config, ws)
    return run


def verl_runner(inputs: dict, rejection: bool):
    from verl.protocol import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    from verl.utils.debug.metrics import calculate_debug_metrics

    mask = inputs["mask"].float()
    old, rollout = inputs["trainer_logp"], inputs["sampler_logp"]
    extra = dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_5.0") if rejection else {}
    data = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask,
                                        "responses": torch.zeros(mask.shape, dtype=torch.long)})

    def run() -> None:
        compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_is="token",
                                                      rollout_is_threshold=2.0, **extra)
        calculate_debug_metrics(data)
    return run


def floor_runner(inputs: dict):
    tensors = [inputs[k] for k in ("mask", "sampler_logp", "trainer_logp", "token_version")]

    def run() -> None:
        for t in tensors:       # one pass reading every input tensor
            t.sum()
    return run


def histogram_export_runner(inputs: dict):
    """rlwatch's path for the lag histogram alone: vectorised per-token lag counts, bucketed, folded
    into the exported state (what the observe loop below does token by token)."""
    from rlwatch.signals import Pending, Workspace, put_lag_histogram, token_lag_counts
    from rlwatch.state import MetricState

    state, ws = MetricState("bench"), Workspace()
    mask = inputs["mask"].float()

    def run() -> None:
        out = Pending()
        counts, _ = token_lag_counts(inputs["token_version"], inputs["trainer_version"], mask, ws)
        hist = counts[1:]
        n = hist.sum()
        put_lag_histogram(out, hist, n, torch.dot(hist, torch.arange(hist.numel(), dtype=hist.dtype)))
        values = out.resolve()
        state.apply({"token_version_lag": values["token_version_lag"],
                     "token_version_lag_sum": values["token_version_lag_sum"]})
    return run


def observe_loop_seconds(inputs: dict, limit: int) -> float:
    """The naive path: prometheus_client Histogram.observe() once per token (timed on ``limit`` tokens
    and scaled to the whole batch, since the loop is linear)."""
    from prometheus_client import CollectorRegistry, Histogram

    from rlwatch.metrics import LAG_BUCKETS

    hist = Histogram("lag", "lag", buckets=[float(b) for b in LAG_BUCKETS], registry=CollectorRegistry())
    lags = (inputs["trainer_version"] - inputs["token_version"])[inputs["mask"]].tolist()
    sample = lags[:limit]
    start = time.perf_counter()
    for value in sample:
        hist.observe(value)
    return (time.perf_counter() - start) * len(lags) / len(sample)


def peak_memory_child(which: str, B: int, T: int) -> None:
    inputs = make_inputs(B, T)
    runner = {"rlwatch": lambda: rlwatch_runner(inputs), "verl": lambda: verl_runner(inputs, True)}[which]()
    small = make_inputs(8, 16)
    (rlwatch_runner(small) if which == "rlwatch" else verl_runner(small, True))()   # thread pools, imports
    with open("/proc/self/clear_refs", "w") as f:    # reset the peak-RSS mark (VmHWM) to the current RSS
        f.write("5")
    base = _rss_kib("VmRSS")
    runner()
    runner()
    peak = _rss_kib("VmHWM")
    input_bytes = sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))
    print(json.dumps(dict(extra=(peak - base) * 1024, inputs=input_bytes)))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def peak_memory(which: str, B: int, T: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--memory-child", which, "--B", str(B), "--T", str(T)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--B", type=int, default=512)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--observe-sample", type=int, default=200_000)
    parser.add_argument("--memory-child", choices=["rlwatch", "verl"])
    args = parser.parse_args()
    if args.memory_child:
        peak_memory_child(args.memory_child, args.B, args.T)
        return

    inputs = make_inputs(args.B, args.T)
    runners = {
        "rlwatch full signal set": rlwatch_runner(inputs),
        "verl IS+RS+debug metrics": verl_runner(inputs, True),
        "verl IS+debug metrics": verl_runner(inputs, False),
        "memory-bound floor": floor_runner(inputs),
        "rlwatch lag histogram export": histogram_export_runner(inputs),
    }
    for run in runners.values():          # warm-up: imports, thread pools, workspaces
        run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):          # interleaved, so noise hits every contender alike
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    observe = observe_loop_seconds(inputs, args.observe_sample)
    tokens = int(inputs["mask"].sum())
    print(f"B={args.B} T={args.T}: {tokens:,} response tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds (medians)")
    for name, value in med.items():
        print(f"  {name:<32} {value * 1e3:9.2f} ms")
    print(f"  {'per-token Histogram.observe loop':<32} {observe * 1e3:9.2f} ms")
    ours = med["rlwatch full signal set"]
    print("ratios:")
    print(f"  rlwatch / verl (IS+RS+debug, the same signal set) = {ours / med['verl IS+RS+debug metrics']:.3f}  "
          f"(bar <= 0.25)")
    print(f"  rlwatch / verl (IS+debug only)                     = {ours / med['verl IS+debug metrics']:.3f}")
    print(f"  rlwatch / memory-bound floor                       = {ours / med['memory-bound floor']:.1f}x  "
          f"(long-term goal <= 20x)")
    print(f"  observe loop / vectorised histogram export         = "
          f"{observe / med['rlwatch lag histogram export']:.0f}x  (bar >= 100x)")
    mem_ours, mem_verl = peak_memory("rlwatch", args.B, args.T), peak_memory("verl", args.B, args.T)
    print(f"  extra peak memory / input tensors: rlwatch {mem_ours['extra'] / mem_ours['inputs']:.2f}x "
          f"(bar <= 3x), verl {mem_verl['extra'] / mem_verl['inputs']:.2f}x; inputs {mem_ours['inputs'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
