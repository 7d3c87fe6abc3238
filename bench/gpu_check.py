"""The signal engine on a GPU, in one command (``--quick`` is sized for under 5 minutes on an H100 or
H200; needs only torch with CUDA and this repository; ``--cpu`` runs every part on the CPU, which
tests/test_gpu_plan.py does, to check the script itself):

    python bench/gpu_check.py [--rounds 15] [--cases 40] [--quick] [--cpu] [--no-profile]

1. Correctness: CPU (eager, in chunks) against CUDA (eager in chunks, in one pass, and compiled) on seeded
   random steps: shapes, masks, NaN/inf log-probs, fp32/bf16/fp16/fp64 log-probs, per-token,
   per-sequence and (first, last) versions, groups whose episodes carry different environments.
2. Speed, medians of interleaved rounds, at 32k / 1M / 4M / 16M response tokens: rlwatch
   ``compute_step`` (compiled and eager) against verl's rollout-correction + debug metrics when verl
   imports (``--verl-path DIR`` adds a directory, e.g. unpacked wheels, to sys.path), a straightforward
   eager version of 13 core signals (bench_signals.reference_runner) and one read of the inputs.
3. Profile of one compiled ``compute_step`` at 1M tokens (torch.profiler): aten ops, kernel
   launches, cudaMemcpyAsync calls and device-to-host copies; extra peak device memory / inputs.
   Next to the CUDA launches: inductor's generated kernels for one CPU graph of the same step (the
   proxy tests/test_engine.py bounds in CI; one CPU compilation, ``--no-cpu-kernels`` skips it).
4. bench/gpu_profile.py's tables at 1M tokens (where the time goes, eager and compiled), then a summary
   at 1M tokens side by side: wall time compiled and eager, kernel launches, device-to-host copies,
   extra device memory over the inputs, the values that differ from the CPU's, verl's metrics (or the
   reference), and the operations the eager accelerator plan dispatches (counted on the host).

The compiled engine covers the whole step (token and episode signals, one function, one vector).
Compilations are bounded so that the script stays under 5 minutes: the speed table's signature is
compiled first (the speed table and the profile then compile nothing), and the correctness part
compiles at most MAX_COMPILED_SIGNATURES more, none started COMPILE_BUDGET_S after the script began.

Goals: <= 1.0 ms compiled and <= 2 ms eager at 1M tokens, <= 3 ms at 16M, <= 40 kernel launches, exactly one
device-to-host transfer per step, extra device memory <= 1x the inputs. The script prints each
figure next to its goal and exits non-zero if the correctness comparison fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.bench_signals import (cuda_peak_ratio, floor_runner, have_verl, interleaved, make_inputs, reference_runner,  # noqa: E402
                                 rlwatch_runner, to_device, verl_runner)
from rlwatch import signals  # noqa: E402
from rlwatch.core.errors import HookErrors  # noqa: E402
from rlwatch.core.record import RecordBuilder  # noqa: E402
from rlwatch.signals import SignalConfig, Workspace, compute_step, engine  # noqa: E402

DEVICE = "cuda"          # --dry-run-on-cpu replaces it, to check the script itself on a host without a GPU
MAX_COMPILED_SIGNATURES = 5   # (dtype, version layout, quantile method) combinations compiled
COMPILE_BUDGET_S = 120        # no new compiled signature this long after the script began
SCRIPT_START = time.perf_counter()
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SIZES = ((64, 512), (512, 2048), (1024, 4096), (2048, 8192))


def random_step(seed: int) -> tuple[dict, bool]:
    """A seeded random step (as tests/test_engine.py's property test draws them) and whether its
    |r| quantiles are exact."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    B, T = int(torch.randint(2, 40, (1,), generator=g)), int(torch.randint(2, 300, (1,), generator=g))
    dtype = pick(DTYPES)
    mask = torch.rand(B, T, generator=g) < pick([0.0, 0.5, 1.0])
    sampler = -torch.rand(B, T, generator=g) * 4
    trainer = sampler + pick([0.0, 0.05, 1.0, 30.0]) * torch.randn(B, T, generator=g)
    for t in (sampler, trainer):
        holes = torch.rand(B, T, generator=g) < pick([0.0, 0.1])
        t[holes] = pick([float("nan"), float("-inf"), float("inf")])
    fields = dict(mask=mask, sampler_logp=sampler.to(dtype), trainer_logp=trainer.to(dtype))
    base = 50 - torch.randint(-1, 8, (B,), generator=g)
    layout = pick(["token", "seq", "pair", "none"])
    if layout == "token":
        fields.update(token_version=(base[:, None] + (torch.rand(B, T, generator=g) < 0.3)).long(), trainer_version=50)
    elif layout == "seq":
        fields.update(seq_version=base, trainer_version=50)
    elif layout == "pair":
        fields.update(seq_version=torch.stack([base, base + torch.randint(0, 2, (B,), generator=g)], 1),
                      trainer_version=50)
    groups = int(torch.randint(1, B + 1, (1,), generator=g))
    fields.update(rewards=torch.randint(0, 3, (B,), generator=g).float(),
                  group_ids=torch.randint(0, groups, (B,), generator=g),
                  env=[pick(["math", "code", "chat"]) for _ in range(B)],
                  truncated=torch.rand(B, generator=g) < 0.3)
    return fields, bool(torch.rand(1, generator=g) < 0.5), (str(dtype), layout)


def values_of(fields: dict, device: str, path: str, exact: bool) -> tuple[dict, int]:
    fields = to_device(fields, device)
    ws = Workspace(compile="always" if path == "compiled" else "never")
    record = RecordBuilder(HookErrors(strict=True)).build(0, fields, ws)
    saved = signals.settings.EXACT_QUANTILE_MAX_TOKENS, signals.settings.FUSED_CHUNK_TOKENS
    signals.settings.EXACT_QUANTILE_MAX_TOKENS = 10**12 if exact else -1
    signals.settings.FUSED_CHUNK_TOKENS = 2 * fields["mask"].shape[-1] - 1 if path == "chunked" else 10**12
    try:
        values = compute_step(record, SignalConfig(), ws)
        if path == "compiled":
            engine.wait()
            values = compute_step(record, SignalConfig(), ws)
    finally:
        signals.settings.EXACT_QUANTILE_MAX_TOKENS, signals.settings.FUSED_CHUNK_TOKENS = saved
    return values, ws.compiled_steps


def differences(a: dict, b: dict, rel: float = 1e-4, abs_: float = 1e-5) -> list[str]:
    out = []
    for name in sorted(set(a) | set(b)):
        rows_a, rows_b = a.get(name, {}), b.get(name, {})
        for labels in set(rows_a) | set(rows_b):
            x, y = rows_a.get(labels, "missing"), rows_b.get(labels, "missing")
            same = (x is None and y is None) or (isinstance(x, float) and isinstance(y, float)
                                                  and math.isclose(x, y, rel_tol=rel, abs_tol=abs_))
            if not same:
                out.append(f"{name}{labels}: {x} vs {y}")
    return out


def correctness(cases: int, paths: tuple[str, ...] = ("chunked", "fused", "compiled")) -> bool:
    print(f"== correctness: CPU vs CUDA on {cases} random steps (+ mixed-environment groups)")
    failures, compiled_steps, start = 0, 0, time.perf_counter()
    signatures: set = set()       # compiled ones are capped (each compiles three example sizes)
    for seed in range(cases):
        fields, exact, kind = random_step(seed)
        cpu, _ = values_of(fields, "cpu", "chunked", exact)
        for path in paths:
            if path == "compiled" and (kind, exact) not in signatures:
                if (len(signatures) >= MAX_COMPILED_SIGNATURES
                        or time.perf_counter() - SCRIPT_START > COMPILE_BUDGET_S):
                    continue
                signatures.add((kind, exact))
            cuda, n = values_of(fields, DEVICE, path, exact)
            compiled_steps += n
            diff = differences(cpu, cuda)
            if diff:
                failures += 1
                print(f"  FAIL seed {seed} ({path}): {len(diff)} values differ, e.g. {diff[:3]}")
    mixed = dict(mask=torch.ones(6, 2, dtype=torch.bool), rewards=torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]),
                 group_ids=torch.tensor([0, 0, 1, 1, 2, 2]), env=["math", "code", "math", "math", "code", "code"])
    for _ in range(20):
        v, _ = values_of(mixed, DEVICE, "chunked", True)
        if v["env_zero_variance_groups_ratio"] != {("math",): 0.5, ("code",): 1.0}:
            failures += 1
            print(f"  FAIL env_zero_variance_groups_ratio on CUDA: {v['env_zero_variance_groups_ratio']}")
            break
    status = engine.status()
    print(f"  {DEVICE} runs: {cases} per path of {', '.join(paths)} (compiled: {len(signatures)} signatures), "
          f"{compiled_steps} ran compiled, {len(status['compiled'])} signatures compiled, "
          f"{len(status['failed'])} failed to compile {list(status['failed'].values())[:1]}; "
          f"{failures} failures; {time.perf_counter() - start:.0f} s")
    return failures == 0 and not status["failed"]


def speed(rounds: int, sizes) -> dict:
    """The speed table; returns each size's medians (ms) and extra memory, by (B, T)."""
    verl = have_verl()
    results: dict = {}
    print(f"== speed: medians of {rounds} interleaved rounds (ms); verl {'imported' if verl else 'absent'}")
    cols = ["compiled", "eager", *(["verl IS+RS+debug"] if verl else []), "13-signal reference", "input read"]
    print("  " + " | ".join(["tokens", *cols, "compiled/verl" if verl else "compiled/reference",
                             "extra mem/inputs"]))
    for B, T in sizes:
        inputs = to_device(make_inputs(B, T), DEVICE)
        runners = {"compiled": rlwatch_runner(inputs, "always"), "eager": rlwatch_runner(inputs, "never")}
        if verl:
            runners["verl IS+RS+debug"] = verl_runner(inputs, True)
        runners["13-signal reference"] = reference_runner(inputs)
        runners["input read"] = floor_runner(inputs)
        med = {k: v * 1e3 for k, v in interleaved(runners, rounds, DEVICE).items()}
        versus = med["verl IS+RS+debug"] if verl else med["13-signal reference"]
        memory = {path: cuda_peak_ratio(runners[path], inputs) if DEVICE == "cuda" else float("nan")
                  for path in ("compiled", "eager")}
        tokens = int(inputs["mask"].sum())
        print("  " + " | ".join([f"{tokens / 2**20:.2f}M ({B}x{T})", *(f"{med[c]:.2f}" for c in cols),
                                 f"{med['compiled'] / versus:.2f}x",
                                 f"{memory['compiled']:.2f}x (eager {memory['eager']:.2f}x)"]))
        results[(B, T)] = {**med, "memory": memory, "versus": "verl IS+RS+debug" if verl else "13-signal reference"}
        del inputs, runners
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print("  goals: compiled <= 1.0 ms at 1M tokens, <= 3 ms at 16M; extra device memory <= 1x the inputs")
    return results


def cpu_kernel_count(B: int = 16, T: int = 17) -> float | None:
    """Inductor's generated kernels for one CPU graph of the whole step (the proxy CI measures in
    tests/test_engine.py, bound ``MAX_CPU_KERNELS_PER_GRAPH``): step_core compiled once on a CPU copy
    of a [B, T] step, without inductor's caches; None when compiling on CPU fails (no C++ compiler)."""
    import torch._functorch.config
    import torch._inductor.config
    import torch._inductor.metrics as inductor_metrics
    from torch._dynamo.utils import counters

    from rlwatch.signals import fused
    from rlwatch.signals.step import EpisodeInputs, engine_inputs

    record = RecordBuilder(HookErrors(strict=True)).build(0, make_inputs(B, T), Workspace())
    kernels, graphs = inductor_metrics.generated_kernel_count, counters["stats"]["unique_graphs"]
    try:
        with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            args, exact = engine_inputs(record, SignalConfig())
            episodes = EpisodeInputs(record, SignalConfig()).tensors
            fn = torch.compile(fused.step_core, dynamic=True, fullgraph=True)
            fn(*args[:-1], *episodes, exact_quantiles=exact, over_from=args[-1])
    except Exception as exc:   # noqa: BLE001 -- a report line, not a failure of the GPU check
        print(f"  (CPU kernel count unavailable: {type(exc).__name__}: {str(exc)[:200]})")
        return None
    graphs = counters["stats"]["unique_graphs"] - graphs
    return (inductor_metrics.generated_kernel_count - kernels) / max(graphs, 1)


def profile_counts(B: int = 512, T: int = 2048, cpu_kernels: float | None = None) -> dict:
    """torch.profiler counts of one compute_step (compiled, then eager) on DEVICE: aten ops, kernel
    launches, cudaMemcpyAsync calls and device-to-host copies; and inductor's generated kernels per
    graph (counted when this call compiles). Returns them by path ("compiled", "eager")."""
    counts: dict = {}
    import torch._inductor.metrics as inductor_metrics
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    inputs = to_device(make_inputs(B, T), DEVICE)
    for mode in ("always", "never"):
        path = "compiled" if mode == "always" else "eager"
        kernels_before, graphs_before = inductor_metrics.generated_kernel_count, counters["stats"]["unique_graphs"]
        run = rlwatch_runner(inputs, mode)
        run()
        sync()
        with profile(activities=activities) as prof:
            run()
            sync()
        events = prof.events()
        launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                        "cuLaunchKernelEx"))
        memcpy = sum(1 for e in events if e.name == "cudaMemcpyAsync")
        dtoh = sum(1 for e in events if "DtoH" in e.name or "Device -> Pageable" in e.name
                   or "Device -> Pinned" in e.name)
        aten = sum(1 for e in events if e.name.startswith("aten::"))
        counts[path] = {"launches": launches, "dtoh": dtoh, "memcpy": memcpy, "aten": aten}
        line = (f"== profile of one compute_step at {B}x{T}, {'compiled' if mode == 'always' else 'eager'}: "
                f"{aten} aten ops, {launches} kernel launches (goal <= 40"
                + (f"; CPU inductor proxy: {cpu_kernels:.0f} kernels per graph" if cpu_kernels is not None else "")
                + f"), {memcpy} cudaMemcpyAsync, "
                f"{dtoh} device-to-host copies (goal 1)")
        graphs = counters["stats"]["unique_graphs"] - graphs_before
        if mode == "always" and graphs:
            line += (f"; inductor generated {(inductor_metrics.generated_kernel_count - kernels_before) / graphs:.0f}"
                     f" kernels per graph ({graphs} graphs compiled here)")
        print(line)
    return counts


def values_at(B: int, T: int) -> dict:
    """How many values of one B x T step differ from the CPU's (eager), by path on DEVICE."""
    fields = make_inputs(B, T)
    cpu, _ = values_of(fields, "cpu", "fused", False)
    return {path: len(differences(cpu, values_of(fields, DEVICE, path, False)[0])) for path in ("fused", "compiled")}


def summary(B: int, T: int, speeds: dict, counts: dict, wrong: dict) -> None:
    """The figures of the done-when at B x T side by side, each next to its goal."""
    from bench._dispatch import count_step

    med = speeds[(B, T)]
    ops = sum(count_step(make_inputs(B, T), "accelerator").values())
    print(f"== summary at {B}x{T} ({DEVICE}, torch {torch.__version__}): path | wall ms | launches | "
          f"device-to-host copies | extra memory / inputs | values differing from the CPU's")
    for path, key, goal in (("compiled", "compiled", "<= 1.0 ms, <= 40 launches"), ("eager", "fused", "<= 2 ms")):
        c = counts.get(path, {})
        print(f"  {path} | {med[path]:.2f} | {c.get('launches', 'n/a')} | {c.get('dtoh', 'n/a')} | "
              f"{med['memory'][path]:.2f}x | {wrong[key]}    (goal {goal}, 1 copy, <= 1x, 0 differing)")
    print(f"  {med['versus']} | {med[med['versus']]:.2f} |   ;  input read {med['input read']:.2f} ms")
    print(f"  eager accelerator plan: {ops} kernel-launching operations dispatched (counted on the host, "
          f"bench/_dispatch.py; tests/test_gpu_plan.py bounds it)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="10 cases, 5 rounds, sizes up to 4M tokens")
    parser.add_argument("--dry-run-on-cpu", "--cpu", action="store_true",
                        help="run every part on CPU (small sizes): checks the script, not the GPU")
    parser.add_argument("--no-profile", action="store_true", help="skip bench/gpu_profile.py's tables at 1M tokens")
    parser.add_argument("--no-cpu-kernels", action="store_true",
                        help="skip compiling one CPU graph for the CPU kernel count printed next to the launches")
    parser.add_argument("--verl-path", help="a directory to put on sys.path for verl (e.g. unpacked wheels)")
    args = parser.parse_args()
    if args.verl_path:
        sys.path.insert(0, args.verl_path)
    start = time.perf_counter()
    if args.dry_run_on_cpu:
        global DEVICE
        DEVICE = "cpu"
        print(f"DRY RUN ON CPU (torch {torch.__version__}): checks the script, measures nothing about GPUs")
        ok = correctness(3, ("chunked", "fused"))
        at = (64, 512)
        speeds = speed(2, ((16, 64), at))
        # on CPU: no launches or copies to count, the code runs
        counts = profile_counts(*at, cpu_kernels=None if args.no_cpu_kernels else cpu_kernel_count())
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_check: CUDA is not available (torch " + torch.__version__ + ")")
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
        compile_start = time.perf_counter()
        at = (512, 2048)                # the speed table's signature, traced first at 1M tokens as a run would
        rlwatch_runner(to_device(make_inputs(*at), DEVICE), "always")
        print(f"compiled the speed table's signature in {time.perf_counter() - compile_start:.0f} s")
        ok = correctness(10 if args.quick else args.cases)
        speeds = speed(5 if args.quick else args.rounds, SIZES[:3] if args.quick else SIZES)
        counts = profile_counts(*at, cpu_kernels=None if args.no_cpu_kernels else cpu_kernel_count())
    wrong = values_at(*at)
    ok = ok and not any(wrong.values())
    if not args.no_profile:
        from bench.gpu_profile import profile_step
        profile_step(*at, DEVICE, top=10)
    summary(*at, speeds, counts, wrong)
    print(f"total {time.perf_counter() - start:.0f} s; correctness {'PASSED' if ok else 'FAILED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
