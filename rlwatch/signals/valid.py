"""A chunk's valid-set tensors (:func:`valid_terms`: the valid tokens, r = log pi - log mu and log mu, 0
off the set) and what the fused function reads of them per token: the sampler-probability band
(:func:`band_index`), the extremes of r (:func:`extremes`) and the |r| sample of the quantiles
(:func:`abs_sample`). Shapes [B, T]; the work dtype is float32 or float64."""

from __future__ import annotations

import torch

from .quantities import threshold_names
from .reduce import ABS_SHIFT, cached, count_into, scalar, whole_to_int32_


def valid_terms(mask: torch.Tensor, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, thr: torch.Tensor,
                arithmetic: bool) -> dict[str, torch.Tensor]:
    """The valid-set tensors that :data:`~.quantities.TERMS` read, [B, T] in the work dtype (``thr``'s), and the
    thresholds' device constants by name (0-d, ``cap_w`` = ``cap_em1`` + 1 too); not
    ``em1`` (see :func:`.fused.token_core`'s mismatch part); ``keep`` 0/1 and ``valid`` the same set, boolean unless
    ``arithmetic`` (then ``keep`` itself: boolean tensors and torch.where are slow on CPU)."""
    work = thr.dtype
    trainer = trainer_logp if trainer_logp.dtype == work else trainer_logp.to(work)
    sampler = sampler_logp if sampler_logp.dtype == work else sampler_logp.to(work)
    r = trainer - sampler
    if arithmetic:                      # r - r: 0 where r is finite, NaN elsewhere
        # In place where the buffer was just written (on CPU it is still in cache: several times faster).
        keep = (r - r).add_(mask).nan_to_num_(0.0)                         # the valid tokens: masked, finite r
        r = r.nan_to_num_(0.0, 0.0, 0.0).mul_(keep)                        # 0 off the valid set
        s = (sampler * keep).nan_to_num_(0.0, 0.0, 0.0)
    else:
        valid = torch.eq((r - r).add_(mask), scalar(1.0, r))                # masked, finite r (isfinite costs more)
        zero = scalar(0.0, r)
        r, s = torch.where(valid, r, zero), torch.where(valid, sampler, zero)
        keep = valid.double() if work == torch.float64 else valid.float()   # one dtype in the stacks of terms
    names = threshold_names()         # every device constant by name (0-d), on every path
    named = cached(("named", names), lambda: {n: thr[i] for i, n in enumerate(names) if n != "edges"}, on=thr)
    made = {"valid": keep if arithmetic else valid, "keep": keep, "r": r, "s": s, **named,
            "cap_w": cached(("cap_w",), lambda: named["cap_em1"] + 1.0, on=thr)}
    return made if arithmetic else {**made, "a": r.abs()}      # |r|: stacked with the others, else a term


def band_index(t: dict[str, torch.Tensor], edges: torch.Tensor, compiling: bool, stacked: bool,
                none_slot: bool, row: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's band [B, T]: k for log mu in [edge k-1, edge k) (bucketize is slower on CPU); s = 0 off
    the valid set, in the last band (no valid token counts there), or with ``none_slot`` in one more."""
    s = t["s"]
    if compiling:
        return sum(s >= edges[k] for k in range(edges.shape[0]))
    if stacked:
        return (s >= edges).sum(0)
    # Each comparison as 0/1 in s's dtype (in ``row``, a buffer of s's shape and dtype, or a fresh one),
    # added into one buffer (a boolean result is several times slower to write on CPU), then int32.
    band, row = torch.ge(s, edges[0], out=torch.empty_like(s)), torch.empty_like(s) if row is None else row
    for k in range(1, edges.shape[0]):
        band.add_(torch.ge(s, edges[k], out=row))
    if none_slot:
        band.add_(torch.eq(t["keep"], 0.0, out=row))
    return whole_to_int32_(band) if band.dtype == torch.float32 else band.int()


def extremes(t: dict[str, torch.Tensor], stacked: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """max r, -min r and max |r| over the valid set [3] (-inf, -big or 0 without one: not read then);
    ``out``: None or a dead buffer of r's shape and dtype to work in."""
    keep, r = t["valid"], t["r"]
    if stacked:                                                             # as one group (fewer operations)
        return (torch.where(keep, torch.stack([r, -r, t["a"]]), scalar(-torch.inf, r)).amax((1, 2)) if keep.numel()
                else r.new_zeros(3))
    big = torch.finfo(r.dtype).max / 4                                      # r moved by +big / -big off it
    moved = torch.sub(keep, 1.0, out=out).mul_(-big).add_(r)              # r + 0 on the valid set: exact
    low = moved.amin()
    high = moved.neg_().add_(r, alpha=2.0).amax()             # r + big (keep - 1) (and -0.0 to 0.0, as r + 0)
    return torch.stack([high, -low, torch.maximum(high, -low)])


def abs_sample(t: dict[str, torch.Tensor], exact: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """What the |r| quantiles need of a chunk: exact, |r| on the valid set and +inf off it (flat); else
    the counts of its float32 bit patterns >> ABS_SHIFT (int64 [65536], zeros included), shifted into
    ``out`` (None or a dead int32 buffer of r's shape)."""
    r, keep = t["r"], t["valid"]
    if exact:
        a = t["a"] if "a" in t else r.abs()
        return torch.where(keep if keep.dtype == torch.bool else keep > 0, a, scalar(torch.inf, a)).reshape(-1)
    if r.dtype == torch.float32:            # |r|'s bit pattern: r's without the sign bit
        bits = torch.bitwise_and(r.view(torch.int32), 0x7FFFFFFF, out=out).bitwise_right_shift_(ABS_SHIFT)
    else:
        a32 = r.abs().clamp_(max=float(torch.finfo(torch.float32).max)).float()
        bits = a32.view(torch.int32).bitwise_right_shift_(ABS_SHIFT)
    return count_into(1 << (31 - ABS_SHIFT), bits)
