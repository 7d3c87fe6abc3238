"""What the engine reads of the declaration in :mod:`.quantities`, as named types made once per
declaration (:func:`.reduce.plan`): the fused vector's :class:`TokenLayout` and the token sums'
:class:`TokenPlan` for the stacked and direct paths of :mod:`.fused`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from . import quantities as q
from .reduce import plan
from .settings import compiling


Term = Callable[[dict[str, torch.Tensor]], torch.Tensor]

#: The engine's own terms: they read only the valid-set tensors. Any other term of :data:`~.quantities.TERMS`
#: (one a user declared) can read every one of these as well, made for it (:func:`_declared_term`).
_ENGINE_TERMS = frozenset(("keep", "r", "s", "w_minus_1", "abs_r", "w_truncated_minus_1", "k3", "w", "w_truncated",
                           "r_times_s"))


class _TermsOnDemand(dict):
    """The valid-set tensors, and an engine term made the first time it is read."""

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in _ENGINE_TERMS:
            raise KeyError(name)
        made = self[name] = q.TERMS[name](self)
        return made


def _declared_term(fn: Term) -> Term:
    """A declared term ``fn`` reading the engine's terms by name as well as the valid-set tensors: eagerly
    each is made when first read; compiled all are traced and inductor keeps those the term reads. Its
    result in the work dtype."""
    def term(t: dict[str, torch.Tensor]) -> torch.Tensor:
        given = {k: v for k, v in t.items() if k != "out"}          # terms made for it get fresh buffers
        if not compiling():
            made = fn(_TermsOnDemand(given))
        else:
            for name in q.TERMS:            # in declaration order: a term reads only those before it
                if name in _ENGINE_TERMS and name not in given:
                    given[name] = q.TERMS[name](given)
            made = fn(given)
        work = t["r"].dtype                 # one dtype in the stacks (a bool term too)
        return made if made.dtype == work else made.to(work)
    return term


class TokenLayout(NamedTuple):
    """Positions in :func:`token_core`'s output: ``fields`` by name (``tokens``, then those of
    :func:`~.quantities.token_fields`: an int, a slice for ``by`` sums and ``lag_cum``), ``compiled``
    (1.0 there when compiled code produced the vector) and ``size`` (the episode block starts there)."""

    fields: dict[str, int | slice]
    compiled: int
    size: int


@plan(lambda: (q.TOKEN_SUMS, q.SEQ_SUMS))
def layout(mismatch: bool, lag: bool) -> TokenLayout:
    """The :class:`TokenLayout` of a step with both log-probs (``mismatch``) and versions (``lag``) or not.
    Read-only."""
    at, fields = 1, {"tokens": 0}
    for name, width in q.token_fields(mismatch, lag):
        fields[name], at = (slice(at, at + width), at + width) if width else (at, at + 1)
    return TokenLayout(fields, at, at + 1)


class ThresholdCount(NamedTuple):
    """A count of the tokens whose term is above (``above``) or below the threshold at ``threshold`` in
    :func:`~.quantities.threshold_names`; ``at``: its position among the sums."""

    at: int
    threshold: int
    above: bool


class TermSums(NamedTuple):
    """The direct path's work on one term: ``make`` it from the valid set, then its plain sums and squares
    (positions among the sums), its threshold counts and its ``by`` sums (positions among those)."""

    name: str
    make: Term
    sums: tuple[int, ...]
    squares: tuple[int, ...]
    counts: tuple[ThresholdCount, ...]
    by: tuple[int, ...]


@dataclass(frozen=True)
class TokenPlan:
    """What a step's token and sequence sums read of the declaration, made once per declaration.

    ``sums``: the token sums in the vector's order (plain, squares, threshold counts, ``by``; ``flat`` of
    them before the ``by`` ones). The stacked path: ``plain`` the term of each plain sum, ``squares``
    those of the squares (a slice of the plain rows when they are consecutive ones), ``counted`` those of
    the threshold counts with ``count_at`` (threshold names) and ``count_signs`` (+1 above, -1 below).
    The direct path: ``per_term``. Both: ``terms`` (name, function) in :data:`~.quantities.TERMS` order,
    ``by`` the ``by`` sums, ``by_kinds`` the kinds they split by, and the sequence sums' ``seq_plain``,
    ``seq_count_at``, ``seq_count_signs``."""

    sums: tuple[q.TokenSum, ...]
    flat: int
    terms: tuple[tuple[str, Term], ...]
    plain: tuple[str, ...]
    squares: slice | tuple[str, ...]
    counted: tuple[str, ...]
    count_at: tuple[str, ...]
    count_signs: tuple[float, ...]
    per_term: tuple[TermSums, ...]
    by: tuple[q.TokenSum, ...]
    by_kinds: tuple[str, ...]
    seq_plain: tuple[str, ...]
    seq_count_at: tuple[str, ...]
    seq_count_signs: tuple[float, ...]


@plan(lambda: (q.TOKEN_SUMS, q.SEQ_SUMS, q.TERMS))
def token_plan(lag: bool) -> TokenPlan:
    """The :class:`TokenPlan` of a step with per-token lags (``lag``) or not."""
    sums = tuple(q.token_sums(lag))
    flat = [s for s in sums if not s.by]
    by = tuple(s for s in sums if s.by)
    needed = {s.term for s in sums}
    terms = tuple((name, fn if name in _ENGINE_TERMS else _declared_term(fn)) for name, fn in q.TERMS.items()
                  if name in needed)
    plain = tuple(s.term for s in flat if not (s.square or s.against))
    squares: slice | tuple[str, ...] = tuple(s.term for s in flat if s.square)
    rows = [plain.index(term) if term in plain else -1 for term in squares]
    if rows and rows[0] >= 0 and rows == list(range(rows[0], rows[0] + len(rows))):   # plain rows: a slice, no stack
        squares = slice(rows[0], rows[0] + len(rows))
    counts = [s for s in flat if s.against]
    per_term = tuple(TermSums(
        name, fn, tuple(i for i, s in enumerate(flat) if s.term == name and not (s.square or s.against)),
        tuple(i for i, s in enumerate(flat) if s.term == name and s.square),
        tuple(ThresholdCount(i, q.threshold_names().index(s.against), s.above) for i, s in enumerate(flat)
              if s.term == name and s.against),
        tuple(j for j, s in enumerate(by) if s.term == name)) for name, fn in terms)
    seq_counts = [s for s in q.SEQ_SUMS if s.against]
    return TokenPlan(sums=sums, flat=len(flat), terms=terms, plain=plain, squares=squares,
                     counted=tuple(s.term for s in counts), count_at=tuple(s.against for s in counts),
                     count_signs=tuple(1.0 if s.above else -1.0 for s in counts), per_term=per_term, by=by,
                     by_kinds=tuple(dict.fromkeys(s.by for s in by)),
                     seq_plain=tuple(s.term for s in q.SEQ_SUMS if not s.against),
                     seq_count_at=tuple(s.against for s in seq_counts),
                     seq_count_signs=tuple(1.0 if s.above else -1.0 for s in seq_counts))
