"""The compiled engine and torch's intra-op thread count: dynamo guards each compiled graph on the
thread count of the thread that traced it, and a new thread starts from the process-wide default,
which a step's eager run on the CPU changes for its duration (signals.settings.intra_op_threads)."""

from __future__ import annotations

import math
import threading

import torch

from rlwatch.core.errors import HookErrors
from rlwatch.core.record import RecordBuilder
from rlwatch.signals import SignalConfig, Workspace, compute_step, engine

from tests.conftest import make_step


def _set_default_only(threads: int) -> None:
    """Set the process-wide default a new thread starts from, leaving this thread's count as it is."""
    worker = threading.Thread(target=torch.set_num_threads, args=(threads,))
    worker.start()
    worker.join()


def test_a_fresh_workspace_runs_compiled_when_the_default_differs_while_compiling(monkeypatch):
    """The caller runs at 2 threads while the default a new thread starts from is 1 (as it is while a
    CPU step's eager run holds one thread): the compiling thread traces at the caller's count, so the
    step after the compilation, and a fresh Workspace's first step, run the compiled code."""
    for table in ("_compiled", "_failed", "_traced", "_pending"):
        monkeypatch.setattr(engine, table, {})
    monkeypatch.setattr(engine, "BACKEND", "eager")              # dynamo's guards without inductor's time
    release = threading.Event()
    real_core = engine._fresh_core

    def held_core():                      # the compilation waits until the default has changed
        assert release.wait(600)
        return real_core()
    monkeypatch.setattr(engine, "_fresh_core", held_core)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fields = make_step(B=8, T=16, seed=3)
        ws = Workspace(compile="always")
        record = RecordBuilder(HookErrors(strict=True)).build(0, fields, ws)
        compute_step(record, SignalConfig(), ws)                  # starts the compilation, which waits
        _set_default_only(1)
        release.set()
        engine.wait()
        assert torch.get_num_threads() == 2
        compiled_before = ws.compiled_steps
        compute_step(record, SignalConfig(), ws)
        assert ws.compiled_steps == compiled_before + 1, engine.status()
        fresh = Workspace(compile="always")
        compute_step(RecordBuilder(HookErrors(strict=True)).build(0, fields, fresh), SignalConfig(), fresh)
        assert fresh.compiled_steps == 1, engine.status()
        assert not engine.status()["failed"]
    finally:
        torch.set_num_threads(before)


def test_an_eager_step_beside_a_compilation_takes_the_eager_branches(monkeypatch):
    """torch.compiler.is_compiling() is True on every thread while any thread compiles; the engine's
    branches read signals.settings.compiling() instead, true on the tracing thread alone. An eager
    step on the caller's thread while the engine's thread is inside its compilation runs the eager
    code: not counted as compiled, the eager CPU plan (chunks, its thread count), the same values."""
    from rlwatch.signals import fused, reduce, settings

    for table in ("_compiled", "_failed", "_traced", "_pending"):
        monkeypatch.setattr(engine, table, {})
    inside, release = threading.Event(), threading.Event()

    def held_backend(graph, example_inputs):    # dynamo has traced; the compile session is still open
        inside.set()
        assert release.wait(600)
        return graph.forward
    monkeypatch.setattr(engine, "BACKEND", held_backend)
    fields = make_step(B=8, T=16, seed=5)
    builder = RecordBuilder(HookErrors(strict=True))
    alone = compute_step(builder.build(0, fields, Workspace()), SignalConfig(), Workspace())
    plans = []
    real_plan = settings.engine_plan
    for module in (fused, reduce):                                 # where the engine reads its plan
        monkeypatch.setattr(module, "engine_plan", lambda device: plans.append(real_plan(device)) or plans[-1])
    try:
        compiling = Workspace(compile="always")
        compute_step(builder.build(0, fields, compiling), SignalConfig(), compiling)   # starts the compilation
        assert inside.wait(600), engine.status()
        assert torch.compiler.is_compiling()                       # the process-wide flag, on this thread
        assert not settings.compiling()
        plans.clear()
        beside = Workspace()
        values = compute_step(builder.build(0, fields, beside), SignalConfig(), beside)
        assert beside.compiled_steps == 0
        assert plans and all(plan == real_plan(torch.device("cpu")) for plan in plans), plans
        assert values.keys() == alone.keys()
        for name, series in alone.items():
            for labels, value in series.items():
                got = values[name][labels]
                assert got == value or (math.isnan(value) and math.isnan(got)), name
    finally:
        release.set()
        engine.wait()
