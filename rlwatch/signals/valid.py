"""A chunk's valid-set tensors (:func:`valid_terms`: the valid tokens, r = log pi - log mu and log mu, 0
off the set) and what the fused function reads of them per token: the sampler-probability band
(:func:`band_index`), the extremes of r (:func:`extremes`) and the |r| sample of the quantiles
(:func:`abs_sample`). Shapes [B, T]; the work dtype is float32 or float64."""

from __future__ import annotations

import torch

from .quantities import threshold_names
from .reduce import ABS_SHIFT, cached, count_into, scalar, total
from .settings import compiling


def valid_terms(mask: torch.Tensor, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, thr: torch.Tensor,
                stacked: bool) -> dict[str, torch.Tensor]:
    """The valid-set tensors that :data:`~.quantities.TERMS` read, [B, T] in the work dtype (``thr``'s), but
    ``w_minus_1`` (made by the caller), and the thresholds' device constants by name (0-d); ``keep`` 0/1 and
    ``valid`` the same set. On the stacked path ``valid`` is boolean and ``abs_r`` is made here (one of the
    stacked rows); on the direct path ``valid`` is ``keep`` itself and everything is arithmetic (boolean
    tensors and ``torch.where`` are several times slower on CPU for large chunks)."""
    work = thr.dtype
    trainer = trainer_logp if trainer_logp.dtype == work else trainer_logp.to(work)
    sampler = sampler_logp if sampler_logp.dtype == work else sampler_logp.to(work)
    r = trainer - sampler
    names = threshold_names()       # every device constant by name (0-d), on every path; and C itself
    named = cached(("named", names), lambda: {n: thr[i] for i, n in enumerate(names) if n != "edges"}, on=thr)
    constants = {**named, "cap": cached(("cap",), lambda: named["cap_minus_1"] + 1.0, on=thr)}
    if stacked:
        valid = torch.eq((r - r).add_(mask), scalar(1.0, r))                # masked, finite r (isfinite costs more)
        zero = scalar(0.0, r)
        r, s = torch.where(valid, r, zero), torch.where(valid, sampler, zero)
        keep = valid.double() if work == torch.float64 else valid.float()   # one dtype in the stacks of terms
        return {"valid": valid, "keep": keep, "r": r, "s": s, "abs_r": r.abs(), **constants}
    # r - r: 0 where r is finite, NaN elsewhere; + mask, NaN to 0: the valid tokens as 0/1.
    keep = (r - r).add_(mask).nan_to_num_(0.0)
    r = r.nan_to_num_(0.0, 0.0, 0.0).mul_(keep)
    s = (sampler * keep).nan_to_num_(0.0, 0.0, 0.0)
    return {"valid": keep, "keep": keep, "r": r, "s": s, **constants}


def band_index(s: torch.Tensor, edges: torch.Tensor, stacked: bool) -> torch.Tensor:
    """Each token's band [B, T] (int): k for log mu in [edge k-1, edge k), from ``s`` (0 off the valid set:
    the last band, where no valid token is counted) and ``edges`` [k, 1, 1]. Counted edge by edge
    (``bucketize`` is slower on CPU)."""
    if stacked:
        return (s >= edges).sum(0)
    if compiling():
        return sum(s >= edges[k] for k in range(edges.shape[0]))
    # Eagerly each comparison is written as 0/1 floats (boolean results are several times slower to write
    # on CPU) and added into the first, converted once.
    band, row = torch.ge(s, edges[0], out=torch.empty_like(s)), torch.empty_like(s)
    for k in range(1, edges.shape[0]):
        band.add_(torch.ge(s, edges[k], out=row))
    return band.int()


def extremes(t: dict[str, torch.Tensor], stacked: bool) -> torch.Tensor:
    """max r, -min r and max |r| over the valid set [3] (-inf, -big or 0 without one: not read then)."""
    valid, r = t["valid"], t["r"]
    if stacked:                                                             # as one group (fewer operations)
        return (torch.where(valid, torch.stack([r, -r, t["abs_r"]]), scalar(-torch.inf, r)).amax((1, 2))
                if valid.numel() else r.new_zeros(3))
    # r - big off the valid set (r + 0 on it: exact) for the largest, then r + big for the smallest:
    # arithmetic rather than torch.where, in one fresh buffer.
    big = torch.finfo(r.dtype).max / 4
    moved = (valid - 1.0).mul_(big).add_(r)                                 # r - big (1 - valid)
    high = total(moved, kind="amax")
    low = total(moved.sub_(r, alpha=2.0).neg_(), kind="amin")              # -(r - big (1 - valid) - 2 r)
    return torch.stack([high, -low, torch.maximum(high, -low)])


def abs_sample(t: dict[str, torch.Tensor], exact: bool) -> torch.Tensor:
    """What the |r| quantiles need of a chunk: exact, |r| on the valid set and +inf off it (flat); else
    the counts of its float32 bit patterns >> ABS_SHIFT (int64 [65536], zeros included)."""
    r, valid = t["r"], t["valid"]
    if exact:
        a = t["abs_r"] if "abs_r" in t else r.abs()
        return torch.where(valid if valid.dtype == torch.bool else valid > 0, a, scalar(torch.inf, a)).reshape(-1)
    if r.dtype == torch.float32:            # |r|'s bit pattern: r's without the sign bit
        bits = torch.bitwise_and(r.view(torch.int32), 0x7FFFFFFF).bitwise_right_shift_(ABS_SHIFT)
    else:
        a32 = r.abs().clamp_(max=float(torch.finfo(torch.float32).max)).float()
        bits = a32.view(torch.int32).bitwise_right_shift_(ABS_SHIFT)
    return count_into(1 << (31 - ABS_SHIFT), bits)
