"""The engine's accelerator plan, held on a CPU: forced with ``settings.FORCE_PLAN`` it gives the CPU
plan's values, dispatches the same bounded number of kernel-launching operations at every step size
(no CPU chunking), and transfers to the host once; the compiled plan is traced first at the size of the
step that asked for it, and reduces over the positions by sequence (B rows, whatever the compiler's
split heuristics). bench/gpu_check.py measures the same on a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench._dispatch import count_step, plan
from bench.bench_signals import make_inputs
from rlwatch.core.errors import HookErrors
from rlwatch.core.record import RecordBuilder
from rlwatch.signals import SignalConfig, Workspace, compute_step, engine
from rlwatch.signals.step import EpisodeInputs, engine_inputs

from tests.conftest import make_step
from tests.test_engine import _TransferCounter, assert_same, patched, run, steps

# Kernel-launching operations of one eager step by the accelerator plan (tokens, mismatch, per-token lag,
# groups, environments, truncation: bench_signals.make_inputs), at any size up to
# settings.ACCELERATOR_CHUNK_TOKENS: 289 (torch 2.13; `python bench/gpu_profile.py --cpu` prints it).
# About half are the 17 by-label rows' sums (where + sum each, for band and lag). The CPU plan dispatches
# 545 at 512 x 2048 (four chunks).
MAX_ACCELERATOR_OPS = 300


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=steps(), exact=st.booleans(), chunked=st.booleans())
def test_accelerator_plan_equals_the_cpu_plan(fields, exact, chunked):
    cpu, _ = run(fields, path="fused", exact=exact)
    with plan("accelerator"):
        accelerator, _ = run(fields, path="chunked" if chunked else "fused", exact=exact)
    assert_same(cpu, accelerator)


@pytest.mark.slow
def test_accelerator_plan_dispatches_the_same_bounded_operations_at_every_size():
    small = count_step(make_inputs(32, 512))                    # 16k positions (histogram quantiles)
    large = count_step(make_inputs(256, 2048))                  # 512k positions: one pass, no chunks
    assert sum(large.values()) == sum(small.values()), (large - small) + (small - large)
    assert sum(large.values()) <= MAX_ACCELERATOR_OPS, large.most_common(20)
    # None that waits for an accelerator (an output sized by the data, a value read on the host).
    assert not set(large) & {"bincount", "nonzero", "masked_select", "unique", "_unique2", "_local_scalar_dense"}
    # The CPU plan runs it in two chunks: every token operation once per chunk.
    assert sum(count_step(make_inputs(256, 2048), "cpu").values()) > sum(large.values())


def test_accelerator_plan_transfers_to_the_host_once(monkeypatch):
    fields = make_step(B=16, T=32)
    fields["entropy"] = torch.rand(16, 32)
    ws = Workspace(compile="never")
    record = RecordBuilder(HookErrors(strict=True)).build(3, fields, ws)
    with plan("accelerator"), patched(ACCELERATOR_CHUNK_TOKENS=64):     # and in chunks
        compute_step(record, SignalConfig(), ws)
        counter = _TransferCounter(monkeypatch)
        values = compute_step(record, SignalConfig(), ws)
    assert counter.calls == ["tolist"]
    assert values["mismatch_tokens"][()] > 0


def _reductions_over_all_positions(gm: torch.fx.GraphModule) -> list[str]:
    """The reductions in ``gm`` whose input is [B, T] (both sizes symbolic) and that reduce more than
    the last dimension."""
    found = []
    for node in gm.graph.nodes:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op not in ("call_method", "call_function") or name not in ("sum", "amax", "amin", "max", "min"):
            continue
        x = node.args[0] if node.args else None
        value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or any(isinstance(s, int) for s in value.shape):
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dim not in (-1, 1, (-1,), (1,), [-1], [1]):
            found.append(f"{node.format_node()}")
    return found


@pytest.mark.slow
def test_compiled_plan_is_traced_at_the_step_size_and_reduces_by_sequence(monkeypatch):
    graphs: list[tuple[torch.fx.GraphModule, tuple]] = []

    def capture(gm, example_inputs):
        shapes = tuple(tuple(int(getattr(s, "node", s).hint if hasattr(s, "node") else s) for s in t.shape)
                       for t in example_inputs if isinstance(t, torch.Tensor))
        graphs.append((gm, shapes))
        return gm.forward

    monkeypatch.setattr(engine, "BACKEND", capture)
    for table in ("_compiled", "_failed", "_traced", "_pending"):
        monkeypatch.setattr(engine, table, {})
    torch._dynamo.reset()
    fields = make_inputs(40, 64)
    record = RecordBuilder(HookErrors(strict=True)).build(0, fields, Workspace())
    with torch.inference_mode():                                 # as compute_step makes them
        args, exact = engine_inputs(record, SignalConfig())
        episodes = EpisodeInputs(record, SignalConfig()).tensors
        key = engine.signature(args, exact, episodes)
        engine.run(args, exact, "always", wait=True, episodes=episodes)
    status = engine.status()
    assert key in status["compiled"], status["failed"]
    assert status["traced"][key][0] == (40, 64)
    assert graphs and (40, 64) in graphs[0][1]                   # the first graph's hints: the step's size
    for gm, _ in graphs:
        assert not _reductions_over_all_positions(gm), _reductions_over_all_positions(gm)
    # A step of another size in the same bucket runs the compiled code, without tracing again.
    traced = len(graphs)
    ws = Workspace(compile="always")
    other = RecordBuilder(HookErrors(strict=True)).build(0, make_inputs(48, 80, seed=1), ws)
    values = compute_step(other, SignalConfig(), ws)
    assert ws.compiled_steps == 1 and len(graphs) == traced
    eager, _ = run(make_inputs(48, 80, seed=1), path="fused", exact=True)
    assert_same(eager, values)
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.perf
def test_the_device_check_runs_on_a_cpu():
    """bench/gpu_check.py's dry run on the CPU (every part, small sizes, compiling on the CPU): the
    script a lent GPU runs is the one tested here, and it ends with the side-by-side summary."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu", "--no-cpu-kernels"], cwd=root,
                          capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "correctness PASSED" in out and "== summary at 64x512" in out, out[-3000:]
    assert "kernel-launching operations" in out and "compute_step" in out, out[-3000:]
