"""Small vectorised reductions on the tensors' device, without a host sync: dot products, indicators,
per-device constants, quantiles (exact by one sort, or from bin counts), bin counts, and the |r|
bit-pattern histogram's bins."""

from __future__ import annotations

import math
from typing import Sequence

import torch

# On steps of more than EXACT_QUANTILE_MAX_TOKENS positions, |r| quantiles come from a histogram over
# the float32 bit pattern of |r| (a sort costs n log n): for non-negative floats the
# bits are monotone in the value, and bits >> 15 gives 256 equal-width bins per power of two. A bin's
# midpoint is within 0.2% of any value in it. The bins span [2^-40, 2^24) nats; smaller values count
# as 0 and larger ones share the top bin, represented by the exact maximum.
ABS_SHIFT = 15
ABS_FIRST = (127 - 40) << 8                 # bit-pattern bin of 2^-40
ABS_NBINS = ((127 + 24) << 8) - ABS_FIRST + 2   # + the zero bin and the top bin


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.numel() < 65536:
        # BLAS dot wakes its thread pool even for a few thousand elements, which stalls for a whole
        # scheduler time slice on a busy host; small products stay in one thread this way.
        return (a * b).sum()
    return torch.dot(a.reshape(-1), b.reshape(-1))


def _nonfinite_indicator(x: torch.Tensor) -> torch.Tensor:
    """1.0 where ``x`` is NaN or infinite, else 0.0 (x - x is NaN exactly there)."""
    return (x - x).nan_to_num_(nan=1.0)


_CONSTANTS: dict[tuple[torch.device, torch.dtype, tuple[float, ...]], torch.Tensor] = {}


def _constant(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A [len(values)] tensor on ``device``, copied there once per process (a host-to-device copy
    each step would wait for the device's queue)."""
    key = (device, dtype, tuple(values))
    tensor = _CONSTANTS.get(key)
    if tensor is None:          # read-only, so one made in inference mode serves outside it too
        tensor = _CONSTANTS[key] = torch.tensor(key[2], dtype=dtype, device=device)
    return tensor


def quantile_from_counts(counts: torch.Tensor, values: torch.Tensor, n: torch.Tensor,
                         qs: Sequence[float]) -> torch.Tensor:
    """The ``qs``-quantiles [Q] (linear interpolation between order statistics, as ``torch.quantile``)
    of ``n`` items binned by ``counts`` [K] float64, each bin represented by ``values`` [K]; NaN when
    n is 0. No host sync."""
    ranks, frac = _order_ranks(n, qs, counts.device)
    bins = torch.searchsorted(counts.cumsum(0), ranks, right=True).clamp_max_(counts.numel() - 1)
    return _interpolate(values[bins], frac, n)


def masked_quantiles(values: torch.Tensor, keep: torch.Tensor, n: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """The exact ``qs``-quantiles [Q] float64 (as ``torch.quantile``) of the finite ``values`` where
    ``keep`` is 1 (``n`` of them; same shapes); NaN when n is 0. One sort, no host sync."""
    if values.numel() == 0:                                    # an empty batch: nothing to index
        return torch.full((len(qs),), torch.nan, dtype=torch.float64, device=values.device)
    kept_first = torch.where(keep.reshape(-1) > 0, values.reshape(-1), torch.inf).sort().values
    ranks, frac = _order_ranks(n, qs, values.device)
    return _interpolate(kept_first[ranks.long()].to(torch.float64), frac, n)


def _order_ranks(n: torch.Tensor, qs: Sequence[float], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The order statistics [2, Q] (0-based, as float64) that each ``qs``-quantile of ``n`` items lies
    between, and its position between them [Q] (linear interpolation, as ``torch.quantile``)."""
    top = (n.to(torch.float64) - 1).clamp_min(0)
    rank = _constant(qs, device) * top
    lo_rank = rank.floor()
    return torch.stack([lo_rank, (lo_rank + 1).minimum(top)]), rank - lo_rank


def _interpolate(pairs: torch.Tensor, frac: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Values [Q] between the order statistics ``pairs`` [2, Q]; NaN when there are no items (n = 0)."""
    return torch.where(n > 0, pairs[0] + frac * (pairs[1] - pairs[0]), torch.nan)


def _sorted_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile-compatible q-quantile of a small 1-D tensor whose length is known on host."""
    n = values.numel()
    if n == 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    s = values.sort().values
    rank = q * (n - 1)
    lo = int(math.floor(rank))
    hi = min(lo + 1, n - 1)
    return s[lo] + (rank - lo) * (s[hi] - s[lo])


def count_into(size: int, index: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Occurrences (or integer ``weights``) of ``index`` values in [0, size): [size], exact. Eagerly on
    CPU one ``bincount`` (int64 without weights, float64 with them); elsewhere, and in compiled code,
    an int64 scatter-add into zeros: ``bincount`` sizes its output from the data (compiled code cannot
    have that shape, and it synchronises on accelerators), and integer atomics are exact and fast
    where float64 ones are slow."""
    index = index if index.dim() == 1 else index.reshape(-1)          # a reshape is an operation too
    if weights is not None and weights.dim() != 1:
        weights = weights.reshape(-1)
    if index.device.type == "cpu" and not torch.compiler.is_compiling():         # one operation, no atomics
        if weights is not None and weights.dtype in (torch.float16, torch.bfloat16, torch.float32):
            weights = weights.double()                # float64 sums: exact for whole numbers below 2^53
        return torch.bincount(index, weights, size)
    index = index.long()
    src = torch.ones_like(index) if weights is None else weights.long()
    return torch.zeros(size, dtype=torch.int64, device=index.device).scatter_add(0, index, src)


def bin_counts(index: torch.Tensor, size: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Counts (or weight sums) of ``index`` values in [0, size), float64 [size], without a host sync
    (:func:`count_into`, as float64). Indices must already lie in [0, size); weights must be whole
    numbers there."""
    return count_into(size, index, weights).to(torch.float64)[:size]


_ABS_VALUES: dict[torch.device, torch.Tensor] = {}


def _abs_bin_values(device: torch.device, max_abs: torch.Tensor) -> torch.Tensor:
    """Representative value of each |r| bin: 0, the midpoints of [2^-40, 2^24), then the exact max."""
    mids = _ABS_VALUES.get(device)
    if mids is None:
        k = torch.arange(ABS_FIRST, ABS_FIRST + ABS_NBINS - 1, dtype=torch.int64)
        edges = (k << ABS_SHIFT).to(torch.int32).view(torch.float32).to(torch.float64)
        mids = _ABS_VALUES[device] = ((edges[:-1] + edges[1:]) / 2).to(device)
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    return torch.cat([zero, mids, max_abs.double().reshape(1)])

