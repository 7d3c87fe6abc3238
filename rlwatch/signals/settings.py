"""What the signals are computed against: the size
limits that choose between the exact and the histogram quantiles and the eager chunk size (read at
call time as ``settings.NAME``, so a test can change them), and the
:class:`Workspace` of reused scratch buffers."""

from __future__ import annotations

import contextlib
import threading
from typing import ContextManager, Iterator, NamedTuple

import torch

from .buckets import LAG_BINS, LAG_EXACT_MAX, SAFETY_BOUND  # noqa: F401 - read as settings.NAME too

# Up to this many [B, T] positions per step, |r| quantiles are exact (one sort): on CPU a sort is
# cheaper than the histogram's fixed 16k bins below about 10k positions (measured side by side).
EXACT_QUANTILE_MAX_TOKENS = 8192


# Eagerly on CPU, the fused function runs over chunks of whole sequences of at most this many [B, T]
# positions, so that a large step holds a chunk's intermediates at a time, never the step's (compiled,
# inductor writes no per-position matrix and one chunk serves every size).
FUSED_CHUNK_TOKENS = 262144
# Eagerly on an accelerator, where each operation is a kernel launch (about 5 us each, several hundred a
# chunk): chunks of up to this many positions, so steps up to 4M positions are one pass and a larger
# one holds a 4M-position chunk's intermediates, never the step's.
ACCELERATOR_CHUNK_TOKENS = 1 << 22
# CPU chunks of up to this many positions stack the sums of each kind into one [k, B, T] group (fewer
# operations); larger ones take one term at a time, comparisons written as 0/1 floats (a boolean
# result is several times slower to write on CPU).
STACK_MAX_TOKENS = 4096
# rlwatch's eager CPU work runs on this many intra-op threads, whatever the step's size (the caller's
# setting is restored after). A small step is a few hundred tiny operations, each waiting for the
# other threads to wake (milliseconds per step on a busy host); a large step is memory-bound and one
# thread was faster there too. `python bench/bench_threads.py` (alternating rounds, median wall time per
# compute_step, torch 2.13, 2 cores shared with other work): 8x64 0.82 ms on 1 thread vs 0.81 ms on 2;
# 64x512 11.6 vs 51.9 ms; 512x2048 (1M positions) 132 vs 1,212 ms.
CPU_THREADS = 1
# "cpu" or "accelerator" runs every eager step by that plan whatever its tensors' device (None: by
# the device). tests/test_gpu_plan.py and bench/gpu_profile.py count the accelerator plan's operations
# on a CPU this way.
FORCE_PLAN: str | None = None


def compiling() -> bool:
    """True while ``torch.compile`` traces the calling code, on the tracing thread alone; the branches
    that differ between compiled and eager code read this. (``torch.compiler.is_compiling()`` is one
    process-wide flag, True on every thread while any thread compiles: an eager step beside the engine's
    compiling thread would take the compiled branches, and count itself as compiled.)"""
    return torch.compiler.is_dynamo_compiling()


class EnginePlan(NamedTuple):
    """How the fused function runs a step, chosen for its device (:func:`engine_plan`).

    ``chunk_tokens``: chunks of whole sequences of at most this many positions (0: one pass).
    ``stack_max_tokens``: chunks up to this many positions take the stacked path (0: never).
    ``bincount``: counts and split sums by one ``bincount`` each (CPU: one operation, no atomics); else
    integer scatter-adds and one 0/1 row per label (no data-dependent shape, no host sync).
    ``threads``: intra-op threads for the step (0: the caller's setting, off CPU)."""

    chunk_tokens: int
    stack_max_tokens: int
    bincount: bool
    threads: int


def engine_plan(device: torch.device) -> EnginePlan:
    """The plan for a step on ``device`` (read at call time: a test may change the limits above);
    compiled code has one plan, one pass without chunks on every device."""
    if compiling():
        return EnginePlan(0, 0, False, 0)
    kind = FORCE_PLAN or ("cpu" if device.type == "cpu" else "accelerator")
    if kind == "cpu":
        return EnginePlan(FUSED_CHUNK_TOKENS, STACK_MAX_TOKENS, True, CPU_THREADS)
    return EnginePlan(ACCELERATOR_CHUNK_TOKENS, 0, False, 0)


def intra_op_threads(threads: int) -> ContextManager[None]:
    """``threads`` intra-op threads for the block (0, or the current count: nothing changes; compiled
    code's plan has 0), the caller's count restored after. Setting the count sets the process-wide
    default for threads created later too, so only a thread already at ``threads`` (rlwatch's worker)
    or the training thread calls it with a change."""
    if not threads or threads == torch.get_num_threads():
        return contextlib.nullcontext()
    return _threads(threads)


def set_this_threads_intra_op_threads(threads: int) -> None:
    """Give the calling thread ``threads`` intra-op threads for good, leaving every other thread as it is.

    With OpenMP, each thread that enters a parallel region gets a team of its own. ``torch.set_num_threads``
    sets the calling thread's OpenMP setting and a process-wide default that threads created later start
    from; a throw-away thread puts that default back."""
    default = torch.get_num_threads()
    if default == threads:
        return
    torch.set_num_threads(threads)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="rlwatch-threads")
    restore.start()
    restore.join()


@contextlib.contextmanager
def _threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Workspace:
    """Scratch buffers reused across steps, keyed by name.

    A fresh multi-megabyte CPU tensor page-faults on first touch, which costs more than the
    arithmetic on it; reusing buffers of the same shape makes every step after the first allocate
    nothing. One workspace belongs to one caller at a time (``Watch`` holds a lock). ``compile``
    chooses whether the token signals run compiled (see :mod:`rlwatch.signals.engine`).
    """

    def __init__(self, compile: str | None = None) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.compile = compile       # "auto" (also None), "always" or "never" (the Watch passes RLWATCH_COMPILE)
        self.compiled_steps = 0      # steps whose token signals ran as compiled code

    def get(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if (buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != device
                or buf.is_inference() and not torch.is_inference_mode_enabled()):
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf

