"""The per-token signals as one pure tensor function, shaped for ``torch.compile``, built from the
declaration in :mod:`.quantities`.

:func:`token_core` computes every token- and sequence-level sum of a step (:data:`~.quantities.TOKEN_SUMS`,
:data:`~.quantities.SEQ_SUMS`), the extremes, the |r| quantiles and the version-lag block, packed in
one float64 vector whose layout :func:`.plans.layout` describes, so a step's device work ends in a single
host transfer; :func:`~.quantities.finish_tokens` applies the host formulas.

It has no host synchronisation, no data-dependent shape and no Python branch on tensor values:
``torch.compile(token_core, fullgraph=True, dynamic=True)`` traces it without a graph break and
inductor fuses one reduction per declared sum into a few loops. Eagerly it runs by the plan chosen for
the tensors' device (:func:`.settings.engine_plan`): over chunks of whole sequences (on CPU of at most
``settings.FUSED_CHUNK_TOKENS`` positions, on an accelerator, where every operation is a kernel launch,
of ``settings.ACCELERATOR_CHUNK_TOKENS``), each chunk's :class:`ChunkParts` combined: sums add, extremes
take the maximum, |r| samples and lag histograms add up before the quantiles.

Two paths compute a chunk's sums (:class:`.plans.TokenPlan` says what they read):

- the *stacked* path (the CPU plan, chunks of at most ``settings.STACK_MAX_TOKENS`` positions, where
  dispatch is what a step costs): the sums of one kind stacked into one [k, B, T] group reduced at once;
- the *direct* path (every other chunk, and compiled code): one term at a time, each of its sums one
  reduction (memory traffic is what a large step costs); its ``by`` sums one ``bincount`` by the CPU plan,
  one 0/1 row per label elsewhere (no float atomics: the same values on every device).

Shapes: ``mask`` [B, T] float32 0/1; log-probs [B, T] any float dtype; ``version`` [B, T], [B]
or [B, 2]. Thresholds arrive as small tensors (not Python numbers) so that a new configuration
does not recompile.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from . import quantities as q
from .lag import LAG_BUCKET_OF_BIN, LAG_SIZE, lag_finish, lag_part
from .plans import TokenPlan, token_plan
from .reduce import ABS_FIRST, ABS_NBINS, cached, interpolate, ranks, scalar, total
from .settings import SAFETY_BOUND, EnginePlan, compiling, engine_plan, intra_op_threads
from .valid import abs_sample, band_index, extremes, valid_terms


# Float32 sums of 0/1 rows are exact up to 2**24 positions; a larger eager chunk sums in float64.
_EXACT_F32_COUNT = 1 << 24

def _threshold_slice(names: list[str]) -> slice:
    """Positions of consecutive named thresholds in the thresholds input (the band edges, any number, last)."""
    at = [q.threshold_names().index(n) for n in names]
    assert at == list(range(at[0], at[0] + len(at))), names
    return slice(at[0], None if names == ["edges"] else at[0] + len(at))


def _signs(signs: tuple[float, ...], dtype: torch.dtype, device: torch.device, dims: int) -> torch.Tensor:
    """+1 / -1 per threshold count (above / below) shaped [k, 1 ...]: x * sign - t * sign > 0 is x > t or x < t."""
    return cached(("signs", signs, dtype, device, dims), lambda: torch.tensor(
        signs, dtype=dtype, device=device).view((len(signs),) + (1,) * (dims - 1)))


def _chunks(B: int, T: int, plan: EnginePlan) -> list[tuple[int, int]]:
    """Ranges of whole sequences of at most ``plan.chunk_tokens`` positions (one range compiled)."""
    if not plan.chunk_tokens or B * T <= plan.chunk_tokens:
        return [(0, B)]
    rows = max(1, plan.chunk_tokens // max(T, 1))
    return [(i, min(i + rows, B)) for i in range(0, B, rows)]


class ChunkParts(NamedTuple):
    """What one chunk of sequences adds to a step (see :meth:`combine`); None where the step has no
    versions (the ``lag_`` parts) or not both log-probs (the rest after ``lag_max``).

    tokens: [1] float64, the masked positions. lag_hist: [LAG_BINS] int64 tokens by lag; lag_seq_sums:
    [3] float64 (sequences with a token, their largest lags, those spanning versions); lag_max: [1] the
    largest lag. sums: [K] the token sums (:func:`~.quantities.token_sums` order); extremes: [3] max r,
    -min r, max |r|; seq_sums: [K'] float64 :data:`~.quantities.SEQ_SUMS`; seq_max: [1] the largest
    |s_b|; abs_sample: the |r| sample (exact: |r| on the valid set, +inf off it; else the int64 counts
    of its bit patterns)."""

    tokens: torch.Tensor
    lag_hist: torch.Tensor | None = None
    lag_seq_sums: torch.Tensor | None = None
    lag_max: torch.Tensor | None = None
    sums: torch.Tensor | None = None
    extremes: torch.Tensor | None = None
    seq_sums: torch.Tensor | None = None
    seq_max: torch.Tensor | None = None
    abs_sample: torch.Tensor | None = None

    def combine(self, other: "ChunkParts", exact: bool) -> "ChunkParts":
        """These parts and the next chunk's: the largest values by maximum, the exact |r| samples
        (``exact``) concatenated, every other part summed (float64 or int64: exact counts)."""
        def one(name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
            if a is None or b is None:
                return None
            if name in _LARGEST:
                return torch.maximum(a, b)
            if name == "abs_sample" and exact:
                return torch.cat([a, b])
            return a + b if a.dtype == b.dtype == torch.int64 else a.double() + b
        return ChunkParts(*(one(name, a, b) for name, a, b in zip(ChunkParts._fields, self, other)))


_LARGEST = frozenset(("lag_max", "extremes", "seq_max"))


def token_core(mask: torch.Tensor, trainer_logp: torch.Tensor | None, sampler_logp: torch.Tensor | None,
               version: torch.Tensor | None, trainer_version: torch.Tensor, thresholds: torch.Tensor,
               abs_mids: torch.Tensor, bucket_index: torch.Tensor, qs: torch.Tensor,
               exact_quantiles: bool, over_from: torch.Tensor) -> torch.Tensor:
    """Every token-level sum of one step, packed as :func:`.plans.layout` says (float64 [size]).

    trainer_version: 0-d, float32 below 2**24 (see :func:`.lag.lag_part`), else float64. thresholds:
    float64, as :func:`~.quantities.threshold_names` names them. abs_mids: float64 midpoints of the |r|
    histogram bins; bucket_index: int64 lags at the histogram bucket bounds; qs: float64 (0.5, 0.99).
    ``exact_quantiles`` picks a sort for |r| quantiles (small steps) instead of the bit-pattern
    histogram; ``over_from`` (0-d float64) is the smallest lag above the staleness bound.
    """
    plan = engine_plan(mask.device)
    B, T = mask.shape
    inputs = (mask, version, trainer_logp, sampler_logp)
    args = (trainer_version, thresholds, exact_quantiles, plan)
    with intra_op_threads(plan.threads):
        whole: ChunkParts | None = None
        for lo, hi in _chunks(B, T, plan):
            chunk = inputs if (lo, hi) == (0, B) else tuple(x[lo:hi] if x is not None else None for x in inputs)
            part = _chunk_parts(*chunk, *args)
            whole = part if whole is None else whole.combine(part, exact_quantiles)
    assert whole is not None
    out = [whole.tokens]
    if whole.sums is not None:
        out += _mismatch_finish(whole, mask.numel(), abs_mids, qs, exact_quantiles)
    if whole.lag_hist is not None:
        out += lag_finish(whole.lag_hist, whole.lag_seq_sums, whole.lag_max, bucket_index, qs, over_from)
    # 1 when this ran as compiled code, 0 eagerly. Float64, so that torch.cat promotes every part to
    # float64 (exactly: float32 sums and int64 counts fit).
    device = mask.device
    out.append(cached(("compiled", device), lambda: torch.full(
        (1,), 1.0 if compiling() else 0.0, dtype=torch.float64, device=device)))
    return torch.cat(out)


def _chunk_parts(mask: torch.Tensor, version: torch.Tensor | None, trainer_logp: torch.Tensor | None,
                 sampler_logp: torch.Tensor | None, trainer_version: torch.Tensor, thresholds: torch.Tensor,
                 exact_quantiles: bool, plan: EnginePlan) -> ChunkParts:
    """One chunk's :class:`ChunkParts`: the lag parts with versions, the mismatch parts with both log-probs."""
    per_seq = mask.sum(-1)                                                    # [B] float32
    tokens = per_seq.sum(0, keepdim=True, dtype=torch.float64)                # exact: whole numbers
    lag = (None, None, None)
    lag_bins = None
    if version is not None:
        lag, lag_bins = lag_part(version, trainer_version, mask, per_seq)
    if trainer_logp is None or sampler_logp is None:
        return ChunkParts(tokens, *lag)
    return ChunkParts(tokens, *lag, *_mismatch_part(mask, trainer_logp, sampler_logp, thresholds, lag_bins,
                                                    exact_quantiles, plan))


def _mismatch_part(mask: torch.Tensor, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, thresholds: torch.Tensor,
                   lag_bins: torch.Tensor | None, exact_quantiles: bool, plan: EnginePlan) -> list[torch.Tensor]:
    """A chunk's token sums [K] (:func:`~.quantities.token_sums` order), extremes [3], sequence sums,
    largest |s_b| [1], and its |r| sample (exact: |r| on the valid set, +inf off it; else its
    bit-pattern histogram): the mismatch fields of :class:`ChunkParts`. ``lag_bins``: each token's lag
    bin ([B, T] or [B, 1]) or None."""
    work = torch.float64 if trainer_logp.dtype == torch.float64 else torch.float32
    thr = thresholds if work == torch.float64 else cached(("to", work), lambda: thresholds.to(work), on=thresholds)
    stacked = plan.stack_max_tokens > 0 and mask.numel() <= plan.stack_max_tokens
    t = valid_terms(mask, trainer_logp, sampler_logp, thr, stacked)
    edges = cached(("edges",), lambda: thr[_threshold_slice(["edges"])].view(-1, 1, 1), on=thr)
    index = {"band": band_index(t["s"], edges, stacked), "lag": lag_bins}
    t["w_minus_1"] = torch.clamp(t["r"], -SAFETY_BOUND, SAFETY_BOUND).expm1_()    # 0 off the valid set
    token = token_plan(lag_bins is not None)
    if stacked:
        sums, per_seq = _stacked_sums(token, {name: make(t) for name, make in token.terms}, thr, index)
    else:
        sums, per_seq = _direct_sums(token, t, thr, index, plan.bincount)
    return [sums, extremes(t, stacked), *_sequence_sums(token, per_seq, thresholds), abs_sample(t, exact_quantiles)]


def _lag_buckets(lag_bins: torch.Tensor) -> torch.Tensor:
    """Each token's lag bucket (index into the ``lag`` labels; none for bin 0) from its lag bin."""
    table = cached(("lag_buckets", lag_bins.device), lambda: torch.tensor(LAG_BUCKET_OF_BIN, device=lag_bins.device))
    return torch.take(table, lag_bins.long())                     # (cheaper than indexing)


def _stacked_sums(plan: TokenPlan, terms: dict[str, torch.Tensor], thr: torch.Tensor,
                  index: dict[str, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked path: each kind of sum as one stacked [k, B, T] group reduced at once, in the sums'
    order [K]; and the per-sequence sums of the first two (valid tokens, r) [2, B]."""
    y = torch.stack([terms[name] for name in plan.plain])
    groups = [y]
    squares = plan.squares
    if squares:
        groups.append((y[squares] if isinstance(squares, slice) else torch.stack([terms[n] for n in squares])).square())
    if plan.counted:
        x = terms[plan.counted[0]] if len(set(plan.counted)) == 1 else torch.stack([terms[n] for n in plan.counted])
        signs = _signs(plan.count_signs, thr.dtype, thr.device, 3)
        # (x - t) * sign > 0 as x * sign - t * sign > 0 (the same value: the sign is +-1), one operation.
        neg_at = cached(("neg_at", 3, plan.count_at, plan.count_signs), lambda: -thr[_threshold_slice(
            list(plan.count_at))].view(-1, 1, 1) * signs, on=thr)
        groups.append(torch.addcmul(neg_at, x, signs).gt_(scalar(0.0, neg_at)))          # 0/1 in the work dtype
    # Float32 sums of a chunk's rows are exact for counts (at most STACK_MAX_TOKENS < 2**24 positions);
    # summed in the work dtype, the parts concatenate without mixing dtypes.
    sums = [g.sum((1, 2), dtype=y.dtype) for g in groups]
    if plan.by:
        sums.append(_stacked_by_sums(plan, terms, index))
    return torch.cat(sums) if len(sums) > 1 else sums[0], y[:2].sum(-1)


def _stacked_by_sums(plan: TokenPlan, terms: dict[str, torch.Tensor],
                     index: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """The ``by`` sums, each of its term by its label index (0 .. width - 1; width: none), one after
    another: one bincount of every term at its index plus the offset of its first bin."""
    shape = terms["r"].shape
    widths = tuple(len(q.BY_LABELS[s.by]) for s in plan.by)
    starts = tuple(sum(widths[:i]) + i for i in range(len(widths)))      # each sum: its labels, then none
    labels = {"band": index["band"]}
    if index["lag"] is not None:
        labels["lag"] = _lag_buckets(index["lag"])
    offsets = cached(("by_offsets", widths), lambda: torch.tensor(starts).view(-1, 1, 1))
    at = torch.stack([labels[s.by] if labels[s.by].shape == shape else labels[s.by].expand(shape) for s in plan.by])
    of = torch.stack([terms[s.term] for s in plan.by])
    counts = torch.bincount((at + offsets).reshape(-1), of.reshape(-1), sum(widths) + len(widths))
    return counts.index_select(0, cached(("by_labels", widths), lambda: torch.cat(
        [torch.arange(w) + o for w, o in zip(widths, starts)])))


def _direct_sums(plan: TokenPlan, t: dict[str, torch.Tensor], thr: torch.Tensor,
                 index: dict[str, torch.Tensor | None], bincount: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The direct path: one term at a time, each of its sums one reduction, in the sums' order [K]; and
    the per-sequence sums of the first two (valid tokens, r) [2, B]. Compiled, inductor fuses the
    reductions over the same positions into a few loops (a stack feeding one reduction would be
    materialised, [B, T, K] float64: several times the inputs; tests/test_engine.py forbids it), in
    float64 for exact counts; eagerly in the work dtype (float64 above 2**24 positions). ``bincount``:
    the ``by`` sums by one bincount per term (the CPU plan)."""
    traced = compiling()
    dtype = torch.float64 if traced or t["r"].numel() > _EXACT_F32_COUNT else t["r"].dtype
    flat: list[torch.Tensor] = [None] * plan.flat                    # type: ignore[list-item]
    by: list[list[torch.Tensor]] = [[]] * len(plan.by)               # each: its sums [width] or its 0-d ones
    labels = _by_labels(plan, index, bincount)
    # Eagerly, the threshold counts' 0/1 rows are written into one buffer of the chunk, and the engine's
    # terms into another, term after term (each read before the next is made): a fresh [B, T] buffer per
    # term costs its page faults. Keeps the term buffer: the 1M-token step 1.06x slower without it
    # (`python bench/bench_ab.py f17c287 --B 512 --T 2048 --rounds 8 --steps 2`, this / f17c287 = 0.943).
    row = None if traced else torch.empty_like(t["r"])
    t = t if traced else {**t, "out": torch.empty_like(t["r"])}
    for term in plan.per_term:
        x = term.make(t)
        for at in term.sums:
            flat[at] = total(x, dtype)
        for at in term.squares:
            flat[at] = _sum_of_squares(x, dtype)
        for count in term.counts:
            flat[count.at] = _count(x, thr[count.threshold], count.above, dtype, row)
        if term.by:
            split = _by_sums(x, labels, plan.by_kinds) if bincount else None
            for j in term.by:
                kind = plan.by[j].by
                by[j] = [split[kind]] if split is not None else _by_rows(x, labels, kind, dtype)
    per_seq = torch.stack([t["keep"].sum(-1), t["r"].sum(-1)])
    if bincount and by:
        return torch.cat([torch.stack(flat).double(), *(sums for [sums] in by)]), per_seq
    # One stack of every 0-d sum (compiled: one output buffer, where a cat of stacks is several kernels).
    return torch.stack(flat + [row for rows in by for row in rows]), per_seq


def _sum_of_squares(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum(x^2) in ``dtype``: compiled a fused reduction, eagerly one dot product (no [B, T] temporary)."""
    if compiling():
        return total(x * x, dtype)
    flat = x.reshape(-1) if x.dtype == dtype else x.reshape(-1).to(dtype)
    return torch.dot(flat, flat)


def _count(x: torch.Tensor, threshold: torch.Tensor, above: bool, dtype: torch.dtype,
           row: torch.Tensor | None) -> torch.Tensor:
    """The tokens where ``x`` > ``threshold`` (``above``) or < it, as a sum in ``dtype``. Eagerly the
    comparison is written as 0/1 into ``row`` (x's shape and dtype): a boolean sum is ~4x slower on CPU."""
    if row is None:
        return total(x > threshold if above else x < threshold, dtype)
    return (torch.gt if above else torch.lt)(x, threshold, out=row).sum(dtype=dtype)


def _by_labels(plan: TokenPlan, index: dict[str, torch.Tensor | None], bincount: bool) -> dict[str, torch.Tensor]:
    """What the direct path's ``by`` sums split by. With ``bincount`` (the CPU plan): ``joint``, one
    flat index of each token's (band, lag bin) pair, int32 [B * T]; else each token's label per kind."""
    if not plan.by:
        return {}
    if not bincount:
        return {kind: _lag_buckets(index[kind]) if kind == "lag" else index[kind] for kind in plan.by_kinds}
    joint = index[plan.by_kinds[0]]
    for kind in plan.by_kinds[1:]:          # ((i0 * size1) + i1) * size2 + ...
        joint = (joint * _by_size(kind)).add_(index[kind])
    return {"joint": joint.expand(index["band"].shape).reshape(-1)}


def _by_size(kind: str) -> int:
    """The values of a ``by`` index: the labels (band), the lag bins (lag)."""
    return LAG_SIZE if kind == "lag" else len(q.BY_LABELS[kind])


def _by_sums(x: torch.Tensor, labels: dict[str, torch.Tensor], kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A term's ``by`` sums of every kind, float64 [width] each, from one ``bincount`` of ``x`` by the joint
    index (one axis per kind): the sum over the other axes, the lag bins folded into their buckets."""
    sizes = [_by_size(kind) for kind in kinds]
    counts = torch.bincount(labels["joint"], x.reshape(-1), minlength=math.prod(sizes)).double().view(sizes)
    out = {}
    for axis, kind in enumerate(kinds):
        split = counts.sum([d for d in range(len(kinds)) if d != axis]) if len(kinds) > 1 else counts
        width = len(q.BY_LABELS[kind])
        if kind == "lag":
            table = cached(("lag_buckets", split.device), lambda: torch.tensor(LAG_BUCKET_OF_BIN, device=split.device))
            split = torch.bincount(table, split, width + 1)
        out[kind] = split[:width]
    return out


def _by_rows(x: torch.Tensor, labels: dict[str, Any], kind: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """A ``by`` sum as one 0/1 row per label, each reduced to a 0-d sum (compiled, and by the accelerator
    plan). Each label's row is made once per step and kept in ``labels`` for the kind's other terms (eagerly
    one operation less per term and label)."""
    label = labels[kind]
    rows = labels.get(f"{kind}_rows")
    if rows is None:
        rows = labels[f"{kind}_rows"] = [label == k for k in range(len(q.BY_LABELS[kind]))]
    return [total(torch.where(row, x, 0.0), dtype) for row in rows]


def _sequence_sums(plan: TokenPlan, per_seq: torch.Tensor, thresholds: torch.Tensor) -> list[torch.Tensor]:
    """:data:`~.quantities.SEQ_SUMS` [K] float64 and the largest |s_b| [1] from the per-sequence
    valid tokens and sums of r [2, B]. Without a valid token s_b = 0, so every term but the count is 0
    (log C, log high > 0 > -log C, log low)."""
    per_seq = per_seq.double()
    valid_count, seq_r = per_seq[0], per_seq[1]
    seq_abs = seq_r.abs()
    # 0/1 as float64 (valid_count is a whole number >= 0; gt_ writes 0/1 in place): one dtype in the cat.
    terms = {"has": valid_count.clamp(max=1.0), "abs": seq_abs,
             "chi2": torch.expm1((seq_r + seq_r).clamp_(-2 * SAFETY_BOUND, 2 * SAFETY_BOUND))}
    signs = _signs(plan.seq_count_signs, torch.float64, seq_r.device, 2)
    # (s_b - t) * sign as s_b * sign - t * sign (the same value: the sign is +-1).
    neg_at = cached(("neg_at", 2, plan.seq_count_at, plan.seq_count_signs), lambda: -thresholds[
        _threshold_slice(list(plan.seq_count_at))].view(-1, 1) * signs, on=thresholds)
    rows = torch.cat([torch.stack([terms[name] for name in plan.seq_plain]),
                      torch.addcmul(neg_at, seq_r, signs).gt_(scalar(0.0, neg_at))])
    return [rows.sum(-1), seq_abs.amax(0, keepdim=True) if seq_abs.numel() else seq_abs.new_zeros(1)]


def _mismatch_finish(parts: ChunkParts, n_all: int, abs_mids: torch.Tensor, qs: torch.Tensor,
                     exact: bool) -> list[torch.Tensor]:
    """The mismatch block from the step's parts: the sums, extremes, sequence sums, largest |s_b| and |r|
    quantiles [Q] (meaningless when no token is valid)."""
    sums, extremes, seq_sums, seq_max, sample = (parts.sums, parts.extremes, parts.seq_sums, parts.seq_max,
                                                 parts.abs_sample)
    n = sums[:1]
    lohi, frac = ranks(n, qs)               # (n - 1 exact in the sums' dtype, then float64 with qs)
    if exact:
        if sample.numel() == 0:
            quantiles = torch.zeros(qs.numel(), dtype=torch.float64, device=sums.device)
        else:
            # As non-negative floats (+inf off the valid set) the bit patterns sort as the values (an
            # integer sort is cheaper than a float one), the n valid ones first.
            bits = sample.view(torch.int32 if sample.dtype == torch.float32 else torch.int64)
            quantiles = interpolate(torch.take(bits.sort().values.view(sample.dtype), lohi.long()).double(), frac)
    else:
        every = sample.long() if sample.dtype != torch.int64 else sample
        last = ABS_FIRST + ABS_NBINS - 2
        # Bin 0: below 2^-40, less the n_all - n zeros off the valid set; the top bin: from 2^24.
        hist = torch.cat([every[:ABS_FIRST].sum(0, keepdim=True) - (n_all - n).long(), every[ABS_FIRST:last],
                          every[last:].sum(0, keepdim=True)])
        values = torch.cat([torch.zeros(1, dtype=torch.float64, device=sums.device), abs_mids,
                            extremes[2:].double()])
        at = torch.searchsorted(hist.cumsum(0, dtype=torch.float64), lohi, right=True).clamp_max(hist.numel() - 1)
        quantiles = interpolate(values[at], frac)
    return [sums.double(), seq_sums, extremes.double(), seq_max, quantiles]     # one dtype: a faster cat


def step_core(mask: torch.Tensor, trainer_logp: torch.Tensor | None, sampler_logp: torch.Tensor | None,
              version: torch.Tensor | None, trainer_version: torch.Tensor, thresholds: torch.Tensor,
              abs_mids: torch.Tensor, bucket_index: torch.Tensor, qs: torch.Tensor,
              ok: torch.Tensor | None, rewards: torch.Tensor | None, group_ids: torch.Tensor | None,
              env_index: torch.Tensor | None, env_slots: torch.Tensor | None, truncated: torch.Tensor | None,
              hacked: torch.Tensor | None, bounds: torch.Tensor | None,
              exact_quantiles: bool, over_from: torch.Tensor) -> torch.Tensor:
    """:func:`token_core`'s vector, then (when ``ok`` is given) the episode block of
    :func:`rlwatch.signals.episodes.episode_core`: the whole step in one function, one vector."""
    from .episodes import episode_core

    tokens = token_core(mask, trainer_logp, sampler_logp, version, trainer_version, thresholds, abs_mids,
                        bucket_index, qs, exact_quantiles, over_from)
    if ok is None or bounds is None:
        return tokens
    episodes = episode_core(mask.sum(-1), ok, rewards, group_ids, env_index, env_slots, truncated, hacked,
                            bounds)
    return torch.cat([tokens, episodes])
