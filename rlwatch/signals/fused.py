"""The per-token signals as one pure tensor function, shaped for ``torch.compile``, built from the
declaration in :mod:`.quantities`.

:func:`token_core` computes every token- and sequence-level sum of a step (:data:`~.quantities.TOKEN_SUMS`,
:data:`~.quantities.SEQ_SUMS`), the extremes, the |r| quantiles and the version-lag block, packed in
one float64 vector whose layout :func:`layout` describes, so a step's device work ends in a single
host transfer; :func:`~.quantities.finish_tokens` applies the host formulas.

It has no host synchronisation, no data-dependent shape and no Python branch on tensor values:
``torch.compile(token_core, fullgraph=True, dynamic=True)`` traces it without a graph break and
inductor fuses one reduction per declared sum into a few loops. Eagerly it runs over chunks of whole
sequences of at most ``settings.FUSED_CHUNK_TOKENS`` positions: small ones stack the sums of each kind
into one [k, B, T] group reduced at once (dispatch is what a small step costs); larger ones on CPU
take one term at a time with as few fresh buffers as the sums allow (memory traffic is what a large
step costs), on other devices reduce each sum on its own; chunks' sums add, their extremes take the
maximum, their |r| samples and lag histograms add up before the quantiles. Histograms count in
integers (never float atomics).

Shapes: ``mask`` [B, T] float32 0/1; log-probs [B, T] any float dtype; ``version`` [B, T], [B]
or [B, 2]. Thresholds arrive as small tensors (not Python numbers) so that a new configuration
does not recompile.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from . import quantities as q
from . import settings
from .lag import LAG_BUCKET_OF_BIN, lag_finish, lag_part
from .reduce import ABS_FIRST, ABS_NBINS, cached, interpolate, plan, ranks, scalar
from .settings import SAFETY_BOUND
from .valid import abs_sample, band_index, extremes, valid_terms


# Float32 sums of 0/1 rows are exact up to 2**24 positions; a larger eager chunk sums in float64.
_EXACT_F32_COUNT = 1 << 24
# Eager CPU steps of this many positions or more run on one intra-op thread: their reductions would
# otherwise wake other threads for microseconds of work (and stall for milliseconds on a busy host).
_ONE_THREAD = 4096


#: The engine's own terms: they may write into a dead buffer (``t["out"]``) and read only the valid-set
#: tensors. Any other term of :data:`~.quantities.TERMS` (one a user declared) gets every one of these as well,
#: made for it (:func:`_every_term`): its ``t["a"]`` or ``t["k3"]`` exists on every path.
_ENGINE_TERMS = frozenset(("keep", "r", "s", "em1", "a", "em1_t", "k3", "w", "w_t", "rs"))


class _TermsOnDemand(dict):
    """The valid-set tensors, and an engine term made (fresh, no buffer lent) the first time it is read."""

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in _ENGINE_TERMS:
            raise KeyError(name)
        made = self[name] = q.TERMS[name](self)       # self has no "out": a fresh tensor
        return made


def _every_term(fn: Any) -> Any:
    """A declared term ``fn`` reading the engine's terms by name as well as the valid-set tensors: eagerly
    each is made when first read; compiled all are traced and inductor keeps those the term reads. Its
    result in the work dtype."""
    def term(t: dict[str, torch.Tensor]) -> torch.Tensor:
        given = {k: v for k, v in t.items() if k != "out"}
        if not torch.compiler.is_compiling():
            made = fn(_TermsOnDemand(given))
        else:
            for name in q.TERMS:            # in declaration order: a term reads only those before it
                if name in _ENGINE_TERMS and name not in given:
                    given[name] = q.TERMS[name](given)
            made = fn(given)
        work = t["r"].dtype                 # one dtype in the stacks and the lent buffers (a bool term too)
        return made if made.dtype == work else made.to(work)
    return term


@plan(lambda: (q.TOKEN_SUMS, q.SEQ_SUMS))
def layout(mismatch: bool, lag: bool) -> dict[str, int | slice]:
    """Positions in :func:`token_core`'s output: ``tokens``, the fields of
    :func:`~.quantities.token_fields` (slices for ``by`` sums and ``lag_cum``), then ``compiled`` (1
    when compiled code produced the vector) and ``size``. Read-only."""
    at, pos = 1, {"tokens": 0}
    for name, width in q.token_fields(mismatch, lag):
        pos[name], at = (slice(at, at + width), at + width) if width else (at, at + 1)
    pos["compiled"], pos["size"] = at, at + 1
    return pos


@plan(lambda: (q.TOKEN_SUMS, q.SEQ_SUMS))
def _plan(lag: bool) -> dict[str, Any]:
    """What the token sums of a step (with per-token lags or not) need of the declaration: the sums in
    the vector's order, the terms they read, the terms of each kind of sum, the thresholds and signs
    of the counts, the ``by`` sums with their widths and offsets, and the same for the sequence sums."""
    sums = q.token_sums(lag)
    needed, against = {s.term for s in sums}, [s for s in sums if s.against]
    by, seq_against = [s for s in sums if s.by], [s for s in q.SEQ_SUMS if s.against]
    widths = tuple(len(q.BY_LABELS[s.by]) for s in by)
    plain, squares = [s.term for s in sums if not (s.square or s.against or s.by)], [s.term for s in sums if s.square]
    rows = [plain.index(term) if term in plain else -1 for term in squares]
    if rows and rows[0] >= 0 and rows == list(range(rows[0], rows[0] + len(rows))):   # plain rows: a slice, no stack
        squares = slice(rows[0], rows[0] + len(rows))
    return dict(sums=sums, terms=[(name, fn if name in _ENGINE_TERMS else _every_term(fn))
                                  for name, fn in q.TERMS.items() if name in needed],
                plain=plain, squares=squares, against=[s.term for s in against],
                at=tuple(s.against for s in against), signs=tuple(1.0 if s.above else -1.0 for s in against),
                by=by, widths=widths, starts=[sum(widths[:i]) + i for i in range(len(widths))],
                seq_plain=[s.term for s in q.SEQ_SUMS if not s.against], seq_at=tuple(s.against for s in seq_against),
                seq_signs=tuple(1.0 if s.above else -1.0 for s in seq_against))


def _threshold_slice(names: list[str]) -> slice:
    """Positions of consecutive named thresholds in the thresholds input (the band edges, any number, last)."""
    at = [q.threshold_names().index(n) for n in names]
    assert at == list(range(at[0], at[0] + len(at))), names
    return slice(at[0], None if names == ["edges"] else at[0] + len(at))


def _signs(signs: tuple[float, ...], dtype: torch.dtype, device: torch.device, dims: int) -> torch.Tensor:
    """+1 / -1 per threshold count (above / below) shaped [k, 1 ...]: x * sign - t * sign > 0 is x > t or x < t."""
    return cached(("signs", signs, dtype, device, dims), lambda: torch.tensor(
        signs, dtype=dtype, device=device).view((len(signs),) + (1,) * (dims - 1)))


def _chunks(B: int, T: int) -> list[tuple[int, int]]:
    """Ranges of whole sequences of at most FUSED_CHUNK_TOKENS positions (one range compiled)."""
    if torch.compiler.is_compiling() or B * T <= settings.FUSED_CHUNK_TOKENS:
        return [(0, B)]
    rows = max(1, settings.FUSED_CHUNK_TOKENS // max(T, 1))
    return [(i, min(i + rows, B)) for i in range(0, B, rows)]


def token_core(mask: torch.Tensor, trainer_logp: torch.Tensor | None, sampler_logp: torch.Tensor | None,
               version: torch.Tensor | None, trainer_version: torch.Tensor, thresholds: torch.Tensor,
               abs_mids: torch.Tensor, bucket_index: torch.Tensor, qs: torch.Tensor,
               exact_quantiles: bool, over_from: torch.Tensor) -> torch.Tensor:
    """Every token-level sum of one step, packed as :func:`layout` says (float64 [size]).

    trainer_version: 0-d, float32 below 2**24 (see :func:`.lag.lag_part`), else float64. thresholds:
    float64, as :func:`~.quantities.threshold_names` names them. abs_mids: float64 midpoints of the |r|
    histogram bins; bucket_index: int64 lags at the histogram bucket bounds; qs: float64 (0.5, 0.99).
    ``exact_quantiles`` picks a sort for |r| quantiles (small steps) instead of the bit-pattern
    histogram; ``over_from`` (0-d float64) is the smallest lag above the staleness bound.
    """
    mismatch = trainer_logp is not None and sampler_logp is not None
    B, T = mask.shape
    chunks = _chunks(B, T)
    inputs = (mask, version, trainer_logp, sampler_logp)
    args = (trainer_version, thresholds, exact_quantiles)
    if len(chunks) == 1 and (torch.compiler.is_compiling() or mask.device.type != "cpu" or mask.numel() < _ONE_THREAD):
        whole = _chunk_parts(*inputs, *args)
    else:
        with one_intra_op_thread(mask.device.type == "cpu"):
            whole = []
            for lo, hi in chunks:
                part = _chunk_parts(*(x[lo:hi] if x is not None else None for x in inputs), *args)
                whole = _combine(whole, part, version is not None, mismatch and exact_quantiles) if whole else part
    out = [whole[0]]
    if mismatch:
        out += _mismatch_finish(*whole[4 if version is not None else 1:], mask.numel(), abs_mids, qs,
                                exact_quantiles)
    if version is not None:
        out += lag_finish(*whole[1:4], bucket_index, qs, over_from)
    # 1 when this ran as compiled code, 0 eagerly. Float64, so that torch.cat promotes every part to
    # float64 (exactly: float32 sums and int64 counts fit).
    device = mask.device
    out.append(cached(("compiled", device), lambda: torch.full(
        (1,), 1.0 if torch.compiler.is_compiling() else 0.0, dtype=torch.float64, device=device)))
    return torch.cat(out)


def _chunk_parts(mask: torch.Tensor, version: torch.Tensor | None, trainer_logp: torch.Tensor | None,
                 sampler_logp: torch.Tensor | None, trainer_version: torch.Tensor, thresholds: torch.Tensor,
                 exact_quantiles: bool) -> list[torch.Tensor]:
    """One chunk's parts: tokens [1], the lag parts (with versions), the mismatch parts (with both
    log-probs); see :func:`_combine`."""
    per_seq = mask.sum(-1)                                                    # [B] float32
    parts: list[torch.Tensor] = [per_seq.sum(0, keepdim=True, dtype=torch.float64)]   # exact: whole numbers
    lag_bins = None
    mismatch = trainer_logp is not None and sampler_logp is not None
    # Eagerly on CPU the mismatch part's count of tokens by band x lag bin is the lag histogram too.
    counted = (mismatch and version is not None and version.shape == mask.shape and _cpu_chunk(mask)
               and _cpu_plan(True)["counted"])
    if version is not None:
        lag, lag_bins = lag_part(version, trainer_version, mask, per_seq, histogram=not counted)
        parts += lag
    if mismatch:
        more, hist = _mismatch_part(mask, trainer_logp, sampler_logp, thresholds, lag_bins, exact_quantiles, counted)
        parts += more
        if counted:
            parts[1] = hist
    return parts


def _cpu_chunk(mask: torch.Tensor) -> bool:
    """Whether an eager chunk takes :func:`_cpu_sums` (on CPU, too large to stack)."""
    return mask.device.type == "cpu" and not torch.compiler.is_compiling() and mask.numel() > settings.STACK_MAX_TOKENS


@contextlib.contextmanager
def one_intra_op_thread(wanted: bool) -> Iterator[None]:
    """One intra-op thread for the block when ``wanted``, the caller's setting restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if wanted else threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _combine(whole: list[torch.Tensor], part: list[torch.Tensor], lag: bool, exact: bool) -> list[torch.Tensor]:
    """The parts so far and the next chunk's (tokens, [lag histogram, sequence sums, largest lag], [token
    sums, extremes, sequence sums, largest |s_b|, |r| sample]) combined: by maximum for the largest
    values, the exact |r| samples concatenated, every other part summed (float64 or int64: exact counts)."""
    m = 4 if lag else 1                                                   # the first mismatch part
    largest = ({3} if lag else set()) | {m + 1, m + 3}
    # Integer counts (the |r| histogram: 65536 bins) add in place, into a chunk's own fresh tensor (in cache).
    return [torch.maximum(a, b) if i in largest else torch.cat([a, b]) if exact and i == m + 4 else a.add_(b)
            if a.dtype == b.dtype == torch.int64 else a.double() + b for i, (a, b) in enumerate(zip(whole, part))]


def _mismatch_part(mask: torch.Tensor, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
                   thresholds: torch.Tensor, lag_bins: torch.Tensor | None, exact_quantiles: bool,
                   count_lags: bool = False) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """A chunk's token sums [K] (:func:`~.quantities.token_sums` order), extremes [3], sequence sums,
    largest |s_b| [1], and its |r| sample (exact: |r| on the valid set, +inf off it; else its
    bit-pattern histogram); with ``count_lags`` (:func:`_cpu_sums` only) the lag histogram too."""
    work = torch.float64 if trainer_logp.dtype == torch.float64 else torch.float32
    thr = thresholds if work == torch.float64 else cached(("to", work), lambda: thresholds.to(work), on=thresholds)
    compiling, cpu = torch.compiler.is_compiling(), mask.device.type == "cpu"
    chunk = _cpu_chunk(mask)                        # eagerly on CPU, too large to stack: _cpu_sums
    stacked = not compiling and cpu and not chunk
    t = valid_terms(mask, trainer_logp, sampler_logp, thr, arithmetic=not stacked)
    edges = cached(("edges",), lambda: thr[_threshold_slice(["edges"])].view(-1, 1, 1), on=thr)
    cpu_plan = _cpu_plan(lag_bins is not None) if chunk else None
    row = torch.empty_like(t["r"]) if chunk else None      # the band comparisons' row, then w - 1 (in cache)
    index = {"band": band_index(t, edges, compiling, stacked, chunk and cpu_plan["counted"], row), "lag": lag_bins}
    t["em1"] = torch.clamp(t["r"], -SAFETY_BOUND, SAFETY_BOUND, out=row).expm1_()    # w - 1, 0 off the valid set
    # The lag bucket of each lag bin: per token, or (eagerly on CPU, large chunks) on the bin sums.
    tables = {} if lag_bins is None else {"lag": cached(("lag_buckets", mask.device), lambda: torch.tensor(
        LAG_BUCKET_OF_BIN, device=mask.device))}
    if not chunk:
        index.update({by: torch.take(table, index[by].long()) for by, table in tables.items()})   # (cheaper than [])
    plan, hist, spare = _plan(lag_bins is not None), None, {}
    if chunk:
        parts, per_seq, hist, spare = _cpu_sums(cpu_plan, t, thr, index, tables, count_lags)
    else:
        terms = {name: fn(t) for name, fn in plan["terms"]}
        parts, per_seq = (_eager_sums(plan, terms, thr, index) if stacked
                          else _direct_sums(plan["sums"], terms, thr, index))
    return [torch.cat(parts) if len(parts) > 1 else parts[0], extremes(t, stacked, spare.get("float")),
            *_sequence_sums(plan, per_seq, thresholds), abs_sample(t, exact_quantiles, spare.get("int"))], hist


def _eager_sums(plan: dict[str, Any], terms: dict[str, torch.Tensor], thr: torch.Tensor,
                index: dict[str, torch.Tensor | None]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Eagerly: each kind of sum as one stacked [k, B, T] group reduced at once; and the
    per-sequence sums of the first two (valid tokens, r) [2, B]."""
    y = torch.stack([terms[name] for name in plan["plain"]])
    groups = [y]
    squares = plan["squares"]
    if squares:
        groups.append((y[squares] if isinstance(squares, slice) else torch.stack([terms[n] for n in squares])).square())
    against = plan["against"]
    if against:
        x = terms[against[0]] if len(set(against)) == 1 else torch.stack([terms[name] for name in against])
        signs = _signs(plan["signs"], thr.dtype, thr.device, 3)
        # (x - t) * sign > 0 as x * sign - t * sign > 0 (the same value: the sign is +-1), one operation.
        at = cached(("neg_at", 3, plan["at"], plan["signs"]), lambda: -thr[_threshold_slice(list(plan["at"]))].view(
            -1, 1, 1) * signs, on=thr)
        groups.append(torch.addcmul(at, x, signs).gt_(scalar(0.0, at)))          # 0/1 in the work dtype
    # Float32 sums of a chunk's rows are exact for counts (at most STACK_MAX_TOKENS < 2**24 positions);
    # summed in the work dtype, the parts concatenate without mixing dtypes.
    sums = [g.sum((1, 2), dtype=y.dtype) for g in groups]
    return sums + ([_split_sums(plan, terms, index)] if plan["by"] else []), y[:2].sum(-1)


def _split_sums(plan: dict[str, Any], terms: dict[str, torch.Tensor],
                index: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """The ``by`` sums, each of its term by its index (0 .. width - 1; width: none), one after another:
    one bincount of every term at its index plus its first bin (its labels, then one for none)."""
    shape, widths = terms["r"].shape, plan["widths"]
    offsets = cached(("by_offsets", widths), lambda: torch.tensor(plan["starts"]).view(-1, 1, 1))
    at = torch.stack([index[s.by] if index[s.by].shape == shape else index[s.by].expand(shape) for s in plan["by"]])
    of = torch.stack([terms[s.term] for s in plan["by"]])
    counts = torch.bincount((at + offsets).reshape(-1), of.reshape(-1), sum(widths) + len(widths))
    return counts.index_select(0, cached(("by_labels", widths), lambda: torch.cat(
        [torch.arange(w) + o for w, o in zip(widths, plan["starts"])])))


def _direct_sums(sums: list, terms: dict[str, torch.Tensor], thr: torch.Tensor,
                 index: dict[str, torch.Tensor | None]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One reduction per sum, in the eager order (compiled, and eagerly on other devices): nothing
    stacked is written. Compiled, inductor fuses the reductions over the same positions into a few
    loops (a stack feeding one reduction would be materialised, [B, T, K] float64: several times the
    inputs; tests/test_engine.py forbids it), float64 for exact counts. A ``by`` sum is one 0/1 row per
    label (no float atomics: the same values on every device)."""
    compiling = torch.compiler.is_compiling()
    dtype = torch.float64 if compiling or terms["r"].numel() > _EXACT_F32_COUNT else None
    rows = []
    for s in sums:
        x = terms[s.term]
        if s.square:
            rows.append(x * x)
        elif s.against:
            t = thr[q.threshold_names().index(s.against)]
            d = x - t if s.above else t - x          # > 0 where x > t (x < t): x - t is 0 only where x == t
            rows.append(d > 0 if compiling else d.sign_().clamp_(min=0.0))
        elif s.by:
            rows += [torch.where(index[s.by] == k, x, 0.0) for k in range(len(q.BY_LABELS[s.by]))]
        else:
            rows.append(x)
    return [torch.stack([row.sum(dtype=dtype) for row in rows])], torch.stack([terms["keep"].sum(-1),
                                                                              terms["r"].sum(-1)])


@plan(lambda: (q.TOKEN_SUMS, q.SEQ_SUMS))
def _cpu_plan(lag: bool) -> dict[str, Any]:
    """:func:`_cpu_sums`' work by term: for each term the sums read (in :data:`~.quantities.TERMS` order),
    its reductions (position among the sums before the ``by`` ones, kind, the threshold's position in
    :func:`~.quantities.threshold_names` and direction), the positions of its ``by`` sums and whether they are
    counts (``keep``'s, with ``counted``); the ``by`` sums; how many others there are; ``counted``: the
    valid tokens by joint index are counted (with the others in the band's last slot, none)."""
    token = _plan(lag)
    flat, by = [s for s in token["sums"] if not s.by], [s for s in token["sums"] if s.by]
    counted = any(s.by == "band" for s in by)
    steps = [(fn, [(i, "square" if s.square else "count" if s.against else "sum",
                    q.threshold_names().index(s.against) if s.against else -1, s.above)
                   for i, s in enumerate(flat) if s.term == name], [j for j, s in enumerate(by) if s.term == name],
              counted and name == "keep") for name, fn in token["terms"]]
    return dict(steps=steps, by=by, size=len(flat), counted=counted)


def _cpu_sums(plan: dict[str, Any], t: dict[str, torch.Tensor], thr: torch.Tensor,
              index: dict[str, torch.Tensor | None], tables: dict[str, torch.Tensor],
              count_lags: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None, dict]:
    """Eagerly on CPU, chunks too large to stack. Memory-bound: one term at a time (a term made from
    others is written into the buffer of the last one made, read a moment ago: in cache), each sum
    one reduction, each square one dot product, each threshold count a 0/1 row in one reused buffer
    and its sum, the ``by`` sums one bincount per term by :func:`_joint_index` (``keep``'s: the count
    of every token, the band's last slot holding those off the valid set); the per-sequence sums as
    :func:`_eager_sums`; with ``count_lags``, the lag histogram from that count (tokens by lag bin, in
    every band slot); and the [B, T] buffers dead after it (``spare``: float, int32, or None). A chunk
    of more than 2**24 positions sums in float64 (exact counts)."""
    shape, wide = t["r"].shape, t["r"].numel() > _EXACT_F32_COUNT
    values: list[torch.Tensor] = [None] * plan["size"]                # type: ignore[list-item]
    splits: list[torch.Tensor] = [None] * len(plan["by"])              # type: ignore[list-item]
    joint, kinds, sizes, dead = _joint_index(plan["by"], index, tables, shape) if plan["by"] else (None, [], [], None)
    every = torch.bincount(joint, minlength=math.prod(sizes)).view(sizes) if plan["counted"] else None
    # The counts' buffer: an index added into the joint one (just read: in cache) where its bytes fit.
    fits = dead is not None and t["r"].dtype == torch.float32 and not wide
    scratch = dead.view(torch.float32).view(-1) if fits else None
    base = {id(v) for v in t.values()}
    for fn, reductions, split_at, counted in plan["steps"]:
        term = fn(t)
        x = term.reshape(-1)
        x = x.double() if wide else x
        for at, kind, threshold, above in reductions:
            if kind == "sum":
                values[at] = x.sum()
            elif kind == "square":
                values[at] = torch.dot(x, x)
            else:       # the comparison as 0/1 floats (a boolean count is slower on CPU), one buffer
                scratch = torch.empty_like(x) if scratch is None else scratch     # every term: one dtype
                values[at] = (torch.gt if above else torch.lt)(x, thr[threshold], out=scratch).sum()
        if split_at:
            counts = every if counted else torch.bincount(joint, x, math.prod(sizes)).view(sizes)
            # Each split's labels and its none slot; the band's last one (off the valid set) dropped.
            counts = counts.narrow(kinds.index("band"), 0, len(q.BY_LABELS["band"])) if plan["counted"] else counts
            counts = counts.double()
            for j in split_at:
                splits[j] = _split_of(counts, kinds, plan["by"][j], tables)
        if id(term) not in base:        # made here: the next term made here writes into it (in cache)
            t["out"] = term
        elif "out" not in t and scratch is not None and scratch.dtype == term.dtype:   # lent: counts take another
            t["out"], scratch = scratch.view(term.shape), None
        del x, term
    parts = [torch.stack(values)] + ([torch.cat(splits)] if splits else [])
    hist = every.sum([d for d, kind in enumerate(kinds) if kind != "lag"])[1:] if count_lags else None
    spare = {"float": t.pop("out", None),             # dead now, both made in this chunk (the int32 joint: lags)
             "int": joint.view(shape) if joint is not None and joint.dtype == torch.int32 else None}
    return parts, torch.stack([t["keep"].sum(-1), t["r"].sum(-1)]), hist, spare


def _joint_index(by: list, index: dict[str, torch.Tensor | None], tables: dict[str, torch.Tensor],
                 shape: torch.Size) -> tuple[torch.Tensor, list[str], list[int], torch.Tensor | None]:
    """The joint index of every split of the ``by`` sums (band x lag bin: 5 x 4097 values), flat integers
    [B * T] for a [B, T] chunk, with the splits' names and sizes (row-major), and an int32 [B, T] index
    added into another's buffer, dead after (None if none)."""
    kinds = list(dict.fromkeys(s.by for s in by))
    sizes = [tables[k].numel() if k in tables else len(q.BY_LABELS[k]) + 1 for k in kinds]
    joint, dead = index[kinds[0]], None
    for kind, size in zip(kinds[1:], sizes[1:]):      # ((i0 * size1) + i1) * size2 + ...
        at = index[kind]
        # Into the split's own index where it is a fresh int32 [B, T] (the lag bins, not read after):
        # written while in cache.
        if at.dtype == torch.int32 and at.shape == shape:
            dead = joint if joint.dtype == torch.int32 and joint.shape == shape and dead is None else dead
            joint = at.add_(joint, alpha=size)
        else:
            joint = torch.add(at.int(), joint.int(), alpha=size)
    return joint.expand(shape).reshape(-1), kinds, sizes, dead


def _split_of(counts: torch.Tensor, kinds: list[str], s: Any, tables: dict[str, torch.Tensor]) -> torch.Tensor:
    """A ``by`` sum [width] from a term's sums by joint index (``counts``, one axis per split): the sum
    over the other splits' axes, by its table where it has one."""
    axis = kinds.index(s.by)
    split = counts.sum([d for d in range(len(kinds)) if d != axis]) if len(kinds) > 1 else counts
    width = len(q.BY_LABELS[s.by])
    return (torch.bincount(tables[s.by], split, width + 1) if s.by in tables else split)[:width]


def _sequence_sums(plan: dict[str, Any], per_seq: torch.Tensor, thresholds: torch.Tensor) -> list[torch.Tensor]:
    """:data:`~.quantities.SEQ_SUMS` [K] float64 and the largest |s_b| [1] from the per-sequence
    valid tokens and sums of r [2, B]. Without a valid token s_b = 0, so every term but the count is 0
    (log C, log high > 0 > -log C, log low)."""
    per_seq = per_seq.double()
    valid_count, seq_r = per_seq[0], per_seq[1]
    seq_abs = seq_r.abs()
    # 0/1 as float64 (valid_count is a whole number >= 0; gt_ writes 0/1 in place): one dtype in the cat.
    terms = {"has": valid_count.clamp(max=1.0), "abs": seq_abs,
             "chi2": torch.expm1((seq_r + seq_r).clamp_(-2 * SAFETY_BOUND, 2 * SAFETY_BOUND))}
    signs = _signs(plan["seq_signs"], torch.float64, seq_r.device, 2)
    # (s_b - t) * sign as s_b * sign - t * sign (the same value: the sign is +-1).
    at = cached(("neg_at", 2, plan["seq_at"], plan["seq_signs"]), lambda: -thresholds[
        _threshold_slice(list(plan["seq_at"]))].view(-1, 1) * signs, on=thresholds)
    rows = torch.cat([torch.stack([terms[name] for name in plan["seq_plain"]]),
                      torch.addcmul(at, seq_r, signs).gt_(scalar(0.0, at))])
    return [rows.sum(-1), seq_abs.amax(0, keepdim=True) if seq_abs.numel() else seq_abs.new_zeros(1)]


def _mismatch_finish(sums: torch.Tensor, extremes: torch.Tensor, seq_sums: torch.Tensor, seq_max: torch.Tensor,
                     sample: torch.Tensor, n_all: int, abs_mids: torch.Tensor, qs: torch.Tensor,
                     exact: bool) -> list[torch.Tensor]:
    """The mismatch block: the sums, extremes, sequence sums, largest |s_b| and |r| quantiles [Q]
    (meaningless when no token is valid)."""
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
