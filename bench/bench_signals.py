"""One step of B=512, T=2048 (1M response tokens): rlwatch's full signal set against verl's own
rollout-correction metrics, a straightforward eager version of the core signals, a memory-bound
floor, and the per-token Histogram.observe loop.

Timings are interleaved round by round in one process and reported as medians, so the ratios
stay meaningful on a shared, noisy machine. Peak memory is measured in fresh subprocesses
(ru_maxrss growth over the inputs) on CPU, with torch.cuda.max_memory_allocated on CUDA. Run:

    python bench/bench_signals.py [--rounds 15] [--B 512] [--T 2048] [--device cpu|cuda] [--compile]
    python bench/bench_signals.py --tiny [--compile]   # small steps: this engine vs the one before it

``--compile`` times the compiled engine (compiled first, off the clock). Without verl installed
the verl rows are left out (bench/gpu_check.py carries its own reference formulas).
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


def to_device(inputs: dict, device: str) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def rlwatch_runner(inputs: dict, compile: str = "never", module=None):
    """compute_step on ``inputs`` (the in-place/fused eager engine unless ``compile`` is
    "always"; then compiled first, off the clock). ``module``: another signals module (the old one)."""
    from rlwatch.core.errors import HookErrors
    from rlwatch.core.record import RecordBuilder

    if module is None:
        from rlwatch import signals as module
        ws = module.Workspace(compile=compile)
    else:
        ws = module.Workspace()
    builder, config = RecordBuilder(HookErrors(strict=True)), module.SignalConfig()

    def run() -> None:
        module.compute_step(builder.build(0, inputs, ws), config, ws)
    if compile == "always":
        from rlwatch.signals import engine
        run()
        engine.wait()
        run()
        assert ws.compiled_steps, f"no compiled step: {engine.status()}"
    return run


def reference_runner(inputs: dict):
    """A straightforward eager version of 13 core signals (as verl writes them: masked means of the
    per-token IS weight, KL estimators, chi2, truncation fractions, sequence-level sums), one host
    transfer at the end. The reference on hosts without verl."""
    mask = inputs["mask"].float()
    old, rollout = inputs["trainer_logp"], inputs["sampler_logp"]

    def run() -> list[float]:
        n = mask.sum()
        r = (old - rollout).clamp(-20, 20) * mask
        w = r.exp() * mask
        seq = r.sum(-1)
        vals = [(r.sum() / n), (-r).sum() / n, (0.5 * r * r).sum() / n, ((w - 1 - r) * mask).sum() / n,
                ((w * w - 1) * mask).sum() / n, ((w > 2.0).float() * mask).sum() / n,
                ((w < 0.5).float() * mask).sum() / n, w.sum() ** 2 / (n * (w * w).sum()),
                (w.clamp(max=2.0) * mask).sum() / n, r.abs().amax(), seq.abs().mean(),
                (seq.clamp(-20, 20).exp() ** 2).mean() - 1, (seq.exp() > 2.0).float().mean()]
        return torch.stack(vals).tolist()
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
        torch.stack([t.sum().double() for t in tensors]).tolist()    # one pass reading every input
    return run


def have_verl() -> bool:
    try:
        import verl.trainer.ppo.rollout_corr_helper  # noqa: F401
        import verl.utils.debug.metrics  # noqa: F401
    except Exception:  # noqa: BLE001 -- any import failure means: not usable here
        return False
    return True


def interleaved(runners: dict, rounds: int, device: str, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each runner, timed round by round in turn (after a warm-up).
    ``clock``: wall time by default; time.process_time gives the CPU time of every thread."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for run in runners.values():
        run()
    sync()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            sync()
            start = clock()
            run()
            sync()
            times[name].append(clock() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


TINY_SHAPES = ((8, 8), (8, 64), (16, 128), (32, 64))
#: The last commit before the fused engine: its rlwatch/signals.py is the "before" of --tiny.
BASELINE_REVISION = "369ad41"


def load_baseline(revision: str = BASELINE_REVISION):
    """rlwatch/signals.py as of ``revision``, read from git (no copy kept in the tree) and loaded as a
    module of its own next to the installed rlwatch, for timing the two engines in one process."""
    import types
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(["git", "-C", str(root), "show", f"{revision}:rlwatch/signals.py"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--tiny needs the git history of this checkout (git show {revision}): {shown.stderr.strip()}")
    module = types.ModuleType("rlwatch_signals_before")
    sys.modules[module.__name__] = module          # dataclasses look their module up by name
    source = shown.stdout.replace("from .", "from rlwatch.")
    exec(compile(source, f"{revision}:rlwatch/signals.py", "exec"), module.__dict__)
    return module


def tiny(args) -> None:
    """Small steps: the engine before the fused one (:func:`load_baseline`) against this one,
    eager and (with --compile) compiled, per-step medians in one process."""
    baseline = load_baseline()

    print(f"small steps, torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
          f"{args.rounds} interleaved rounds of 20 steps; per step: median CPU time of every thread "
          f"(process_time; what the step costs the host) and median wall time")
    cols = ["before", "eager", *(["compiled"] if args.compile else [])]
    print(f"  {'B x T':>10} " + " ".join(f"{c + ' cpu/wall (ms)':>26}" for c in cols)
          + "  eager/before cpu" + ("  compiled/before cpu" if args.compile else ""))
    for B, T in TINY_SHAPES:
        inputs = to_device(make_inputs(B, T), args.device)
        runners = {"before": rlwatch_runner(inputs, module=baseline), "eager": rlwatch_runner(inputs)}
        if args.compile:
            runners["compiled"] = rlwatch_runner(inputs, "always")
        batched = {name: (lambda run=run: [run() for _ in range(20)]) for name, run in runners.items()}
        cpu = {k: v / 20 for k, v in interleaved(batched, args.rounds, args.device, time.process_time).items()}
        wall = {k: v / 20 for k, v in interleaved(batched, args.rounds, args.device).items()}
        line = f"  {f'{B} x {T}':>10} " + " ".join(f"{f'{cpu[c] * 1e3:.3f} / {wall[c] * 1e3:.3f}':>26}" for c in cols)
        line += f"  {cpu['eager'] / cpu['before']:16.2f}"
        if args.compile:
            line += f"  {cpu['compiled'] / cpu['before']:19.2f}"
        print(line)


def histogram_export_runner(inputs: dict):
    """rlwatch's path for the lag histogram alone: a step with per-token versions and no log-probs
    (vectorised lag counts, bucketed), folded into the exported state (what the observe loop below
    does token by token)."""
    from rlwatch.core.errors import HookErrors
    from rlwatch.core.record import RecordBuilder
    from rlwatch.signals import SignalConfig, Workspace, compute_step
    from rlwatch.core.state import MetricState

    state, ws = MetricState("bench"), Workspace(compile="never")
    fields = {k: inputs[k] for k in ("mask", "token_version", "trainer_version")}
    record = RecordBuilder(HookErrors(strict=True)).build(0, fields, ws)

    def run() -> None:
        values = compute_step(record, SignalConfig(), ws)
        state.apply({"token_version_lag": values["token_version_lag"],
                     "token_version_lag_sum": values["token_version_lag_sum"]})
    return run


def observe_loop_seconds(inputs: dict, limit: int) -> float:
    """The naive path: prometheus_client Histogram.observe() once per token (timed on ``limit`` tokens
    and scaled to the whole batch, since the loop is linear)."""
    from prometheus_client import CollectorRegistry, Histogram

    from rlwatch.core.metrics import LAG_BUCKETS

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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--compile", action="store_true", help="time the compiled engine (compiled first)")
    parser.add_argument("--tiny", action="store_true", help="small steps: this engine vs the one before it")
    parser.add_argument("--observe-sample", type=int, default=200_000)
    parser.add_argument("--memory-child", choices=["rlwatch", "verl"])
    args = parser.parse_args()
    if args.memory_child:
        peak_memory_child(args.memory_child, args.B, args.T)
        return
    if args.tiny:
        tiny(args)
        return

    cpu_inputs = make_inputs(args.B, args.T)
    inputs = to_device(cpu_inputs, args.device)
    verl = have_verl()
    runners = {"rlwatch full signal set": rlwatch_runner(inputs, "always" if args.compile else "never")}
    if verl:
        runners["verl IS+RS+debug metrics"] = verl_runner(inputs, True)
        runners["verl IS+debug metrics"] = verl_runner(inputs, False)
    runners["eager reference, 13 signals"] = reference_runner(inputs)
    runners["memory-bound floor"] = floor_runner(inputs)
    if args.device == "cpu":
        runners["rlwatch lag histogram export"] = histogram_export_runner(inputs)
    med = interleaved(runners, args.rounds, args.device)
    tokens = int(cpu_inputs["mask"].sum())
    print(f"B={args.B} T={args.T}: {tokens:,} response tokens, torch {torch.__version__}, device {args.device}, "
          f"{'compiled' if args.compile else 'eager'} engine, {torch.get_num_threads()} threads, "
          f"{args.rounds} interleaved rounds (medians)")
    for name, value in med.items():
        print(f"  {name:<32} {value * 1e3:9.2f} ms")
    ours = med["rlwatch full signal set"]
    if args.device == "cpu":
        observe = observe_loop_seconds(cpu_inputs, args.observe_sample)
        print(f"  {'per-token Histogram.observe loop':<32} {observe * 1e3:9.2f} ms")
    print("ratios:")
    if verl:
        print(f"  rlwatch / verl (IS+RS+debug, the same signal set) = "
              f"{ours / med['verl IS+RS+debug metrics']:.3f}  (bar <= 0.25)")
        print(f"  rlwatch / verl (IS+debug only)                     = {ours / med['verl IS+debug metrics']:.3f}")
    else:
        print("  (verl not installed: no verl rows)")
    print(f"  rlwatch / eager reference (13 signals)             = {ours / med['eager reference, 13 signals']:.3f}")
    print(f"  rlwatch / memory-bound floor                       = {ours / med['memory-bound floor']:.1f}x  "
          f"(long-term goal <= 20x)")
    if args.device == "cpu":
        print(f"  observe loop / vectorised histogram export         = "
              f"{observe / med['rlwatch lag histogram export']:.0f}x  (bar >= 100x)")
        mem_ours = peak_memory("rlwatch", args.B, args.T)
        line = f"  extra peak memory / input tensors: rlwatch {mem_ours['extra'] / mem_ours['inputs']:.2f}x (bar <= 3x)"
        if verl:
            mem_verl = peak_memory("verl", args.B, args.T)
            line += f", verl {mem_verl['extra'] / mem_verl['inputs']:.2f}x"
        print(line + f"; inputs {mem_ours['inputs'] / 2**20:.1f} MiB")
    else:
        ratio = cuda_peak_ratio(runners['rlwatch full signal set'], inputs)
        print(f"  extra peak device memory / inputs: rlwatch {ratio:.2f}x (bar <= 1x)")


def cuda_peak_ratio(run, inputs: dict) -> float:
    """Peak device memory allocated during one call beyond what was allocated before, over the inputs."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    input_bytes = sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))
    return (torch.cuda.max_memory_allocated() - base) / input_bytes


if __name__ == "__main__":
    main()
