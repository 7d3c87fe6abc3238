"""What one eager step dispatches, counted on any device (a CPU too): the operations that would each
launch a kernel on an accelerator, with the accelerator plan forced (``signals.settings.FORCE_PLAN``).

Counted at torch's dispatcher (a ``TorchDispatchMode``: after autograd and composite operations are
decomposed, as a device sees them); views and allocations launch nothing and are left out.
tests/test_gpu_plan.py bounds the count; bench/gpu_profile.py prints it next to a GPU's launches.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operations that only read or set metadata (no kernel on any device).
_NO_KERNEL = frozenset(("empty", "empty_like", "empty_strided", "lift_fresh", "detach", "alias", "_reshape_alias",
                        "resize_", "set_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size"))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(step: Callable[[], Any]) -> Counter[str]:
    """The kernel-launching operations ``step()`` dispatches, by name (run it once before, so the
    per-process constants are made)."""
    counting = _Count()
    with counting:
        step()
    return counting.ops


@contextlib.contextmanager
def plan(kind: str | None) -> Iterator[None]:
    """Every eager step by the ``"cpu"`` or ``"accelerator"`` plan (None: by the tensors' device)."""
    from rlwatch.signals import settings

    saved, settings.FORCE_PLAN = settings.FORCE_PLAN, kind
    try:
        yield
    finally:
        settings.FORCE_PLAN = saved


def step_runner(inputs: dict, compile: str = "never") -> Callable[[], Any]:
    """One ``compute_step`` of ``inputs`` (a validated record, built once), as a callable."""
    from rlwatch import signals
    from rlwatch.core.errors import HookErrors
    from rlwatch.core.record import RecordBuilder

    ws = signals.Workspace(compile=compile)
    record = RecordBuilder(HookErrors(strict=True)).build(0, inputs, ws)
    config = signals.SignalConfig()
    return lambda: signals.compute_step(record, config, ws)


def count_step(inputs: dict, kind: str | None = "accelerator") -> Counter[str]:
    """The operations one eager compute_step of ``inputs`` dispatches by plan ``kind`` (after one warm step)."""
    with plan(kind), torch.inference_mode():
        run = step_runner(inputs)
        run()
        return dispatched_ops(run)
