"""Small pieces the fused function shares: the per-process constant cache, integer counts by index,
the |r| bit-pattern histogram's bins, and quantile ranks."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from .settings import compiling, engine_plan

# On steps of more than EXACT_QUANTILE_MAX_TOKENS positions, |r| quantiles come from a histogram over
# the float32 bit pattern of |r| (a sort costs n log n): for non-negative floats the
# bits are monotone in the value, and bits >> 15 gives 256 equal-width bins per power of two. A bin's
# midpoint is within 0.2% of any value in it. The bins span [2^-40, 2^24) nats; smaller values count
# as 0 and larger ones share the top bin, represented by the exact maximum.
ABS_SHIFT = 15
ABS_FIRST = (127 - 40) << 8                 # bit-pattern bin of 2^-40
ABS_NBINS = ((127 + 24) << 8) - ABS_FIRST + 2   # + the zero bin and the top bin


_CACHE: dict[tuple, tuple[tuple, Any]] = {}


def cached(key: tuple, make: Callable[[], Any], on: torch.Tensor | None = None, deps: tuple = ()) -> Any:
    """``make()`` once per process and key when eager (a host-to-device copy or an operation less per
    step), or once per ``on`` (an input it is made from, where it is kept), and again when ``deps``
    differ (see :func:`plan`); compiled code makes it inline (a constant of the graph)."""
    if compiling():
        return make()
    store = _CACHE if on is None else on.__dict__.setdefault("_rlwatch_cached", {})
    hit = store.get(key)
    if hit is None or hit[0] != deps:       # read-only: one made in inference mode serves outside it too
        hit = store[key] = (deps, make())
    return hit[1]


def plan(deps: Callable[[], tuple] = tuple) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A function of hashable arguments that reads the declaration, run once per arguments (a step's
    plan: no Python rebuilding it each step) and again when ``deps()`` (the tables it reads; none by
    default) differ. Its result is read-only."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def planned(*args: Any) -> Any:
            return cached((fn, *args), lambda: fn(*args), deps=deps())
        return planned
    return wrap


def constant(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A [len(values)] tensor on ``device``, copied there once per process."""
    values = tuple(values)
    return cached(("constant", device, dtype, values), lambda: torch.tensor(values, dtype=dtype, device=device))


def scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-d tensor of ``like``'s dtype and device, made once per process: an operation
    with a Python number wraps it in a fresh tensor each time (on small CPU tensors about twice the
    operation's cost). As an operand it promotes as the number would (0-d, same dtype)."""
    return cached(("scalar", value, like.dtype, like.device),
                  lambda: torch.tensor(value, dtype=like.dtype, device=like.device))


def abs_bin_values(device: torch.device) -> torch.Tensor:
    """The midpoints of the |r| bit-pattern bins in [2^-40, 2^24) (float64)."""
    def make() -> torch.Tensor:
        k = torch.arange(ABS_FIRST, ABS_FIRST + ABS_NBINS - 1, dtype=torch.int64)
        edges = (k << ABS_SHIFT).to(torch.int32).view(torch.float32).to(torch.float64)
        return ((edges[:-1] + edges[1:]) / 2).to(device)
    return cached(("abs_mids", device), make)


def count_into(size: int, index: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Occurrences (or integer ``weights``) of ``index`` values in [0, size): [size], exact. By the CPU
    plan one ``bincount`` (int64 without weights, float64 with them); elsewhere, and in compiled code,
    an int64 scatter-add into zeros: ``bincount`` sizes its output from the data (compiled code cannot
    have that shape, and it synchronises on accelerators), and integer atomics are exact and fast
    where float64 ones are slow."""
    index = index if index.dim() == 1 else index.reshape(-1)          # a reshape is an operation too
    if weights is not None and weights.dim() != 1:
        weights = weights.reshape(-1)
    if engine_plan(index.device).bincount:                          # the CPU plan: one operation, no atomics
        if weights is not None and weights.dtype in (torch.float16, torch.bfloat16, torch.float32):
            weights = weights.double()                # float64 sums: exact for whole numbers below 2^53
        return torch.bincount(index, weights, size)
    index = index.long()
    src = torch.ones_like(index) if weights is None else weights.long()
    return torch.zeros(size, dtype=torch.int64, device=index.device).scatter_add(0, index, src)


def total(x: torch.Tensor, dtype: torch.dtype | None = None, kind: str = "sum") -> torch.Tensor:
    """The 0-d sum (``kind`` "sum", in ``dtype``), maximum ("amax") or minimum ("amin") of ``x`` [B, T].
    Compiled, by sequence first ([B, T] -> [B] -> 0-d): every reduction over the positions runs as B
    independent rows, which inductor fuses into one kernel of B programs whatever its split heuristics
    (otherwise a reduction over a step of symbolic size may run as one block over every position)."""
    if compiling() and x.dim() == 2:
        rows = x.sum(-1, dtype=dtype) if kind == "sum" else getattr(x, kind)(-1)
        return getattr(rows, kind)()
    return x.sum(dtype=dtype) if kind == "sum" else getattr(x, kind)()


def ranks(n: torch.Tensor, qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The order statistics [2, Q] (0-based, float64) that each ``qs``-quantile of ``n`` items lies
    between, and its position between them [Q] (linear interpolation, as ``torch.quantile``; the upper
    one equals the lower where the rank is whole, which interpolates to the same value). With n = 0
    the ranks are negative (indices from the end, a value the host ignores)."""
    rank = qs * (n - scalar(1.0, n))
    low = rank.floor()
    return torch.stack([low, rank.ceil()]), rank - low


def interpolate(pairs: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """Values [Q] between the order statistics ``pairs`` [2, Q] (float64), as ``torch.quantile``."""
    return torch.lerp(pairs[0], pairs[1], frac)
