"""What a step makes of the declarations: the token vector's fields (:func:`token_sums`,
:func:`token_fields`), the episode matrix's rows (:func:`episode_rows`, :func:`episode_layout`), the
thresholds' values and device constants (:func:`threshold_values`, :func:`threshold_names`,
:func:`device_constants`), and the host formulas applied to the transferred vector
(:func:`finish_tokens`, :func:`finish_episodes`).

Every function reads the declarations through the package (``q.TOKEN_SUMS``, ...), where a test may
replace them, and is re-run when they change (:func:`~rlwatch.signals.reduce.plan`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Mapping, NamedTuple

from .. import quantities as q
from ..buckets import LAG_BUCKET_LABELS
from ..derived import derive_hack_ratios
from ..pending import Values
from ..reduce import plan
from .declare import BY_LABELS, EpisodeRow, GroupRow, TokenSum, _needed


# --- thresholds -------------------------------------------------------------------------------------

def threshold_values(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every declared threshold's value (:data:`~.tokens.SIGNAL_THRESHOLDS`, in declaration order): the one
    ``given`` (checked against its range: ValueError), else its default. TypeError for an unknown name."""
    declared = {t.name: t for t in q.SIGNAL_THRESHOLDS}
    unknown = [name for name in given if name not in declared]
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (signal thresholds: {', '.join(declared)})")
    return {name: t.check(given[name]) if name in given else t.value for name, t in declared.items()}


@plan(lambda: (q.TOKEN_SUMS, q.SEQ_SUMS, q.SIGNAL_THRESHOLDS))
def threshold_names() -> tuple[str, ...]:
    """The device constants' names in the order of the fused function's ``thresholds`` input: those the
    token sums compare against (in the order of the sums: one slice), those of the sequence sums, the
    declared others, then ``edges`` (the sampler-probability band edges, any number, last)."""
    token = [s.against for s in token_sums(False) if s.against]
    seq = [s.against for s in q.SEQ_SUMS if s.against]
    declared = [name for t in q.SIGNAL_THRESHOLDS for name in t.device]
    missing = sorted(set(token + seq) - set(declared))
    if missing:
        raise ValueError(f"sums compare against {missing}, which no declared threshold's device names")
    return (*dict.fromkeys(token + seq + declared), "edges")


def device_constants(values: Mapping[str, Any]) -> dict[str, float]:
    """The named device constants of the thresholds' ``values`` (:func:`threshold_values`)."""
    made: dict[str, float] = {}
    for t in q.SIGNAL_THRESHOLDS:
        made.update(t.constants(values[t.name]))
    return made


# --- tokens -----------------------------------------------------------------------------------------

def token_sums(lag: bool) -> list[TokenSum]:
    """The token sums a step computes, in the order of the fused vector (the ``lag`` splits only with
    versions): plain sums, squares, threshold counts, then the ``by`` slices."""
    sums = [s for s in q.TOKEN_SUMS if lag or s.by != "lag"]
    by = list(dict.fromkeys(s.by for s in sums if s.by))
    return ([s for s in sums if not (s.square or s.against or s.by)] + [s for s in sums if s.square]
            + [s for s in sums if s.against] + sorted((s for s in sums if s.by), key=lambda s: by.index(s.by)))


def token_fields(mismatch: bool, lag: bool) -> list[tuple[str, int]]:
    """(name, width) of each field of the fused vector after ``tokens``; width 0 for a scalar."""
    fields: list[tuple[str, int]] = []
    if mismatch:
        fields += [(s.name, len(BY_LABELS[s.by]) if s.by else 0) for s in token_sums(lag)]
        fields += [(s.name, 0) for s in q.SEQ_SUMS] + [(name, 0) for name in q.MISMATCH_TAIL]
    if lag:
        fields += [(name, len(LAG_BUCKET_LABELS) - 1 if name == "lag_cum" else 0) for name in q.LAG_FIELDS]
    return fields


def fields(v: list[float], pos: dict[str, Any]) -> SimpleNamespace:
    """The fused vector's fields by name: ``f.n`` a float, ``f.band_abs`` a list (a ``by`` slice)."""
    return SimpleNamespace(**{name: v[at] for name, at in pos.items() if name != "size"})


@plan(lambda: (q.METRICS, q.EPISODE_METRICS))
def _metrics(level: str, have: frozenset[str]) -> list[tuple[str, Callable[..., Any], str, list]]:
    """(name, formula, ``by``, [(k, labels)] of a ``by`` slice) of the token or episode metrics whose
    inputs are all in ``have``."""
    return [(m.name, m.fn, m.by, list(enumerate((label,) for label in BY_LABELS.get(m.by, ()))))
            for m in (q.METRICS if level == "tokens" else q.EPISODE_METRICS) if _needed(m.needs, have)]


def _apply(level: str, have: frozenset[str], f: SimpleNamespace,
           per_env: list[tuple[str, SimpleNamespace]] = (), detectors: list[str] = ()) -> Values:
    """The values of the ``level`` metrics whose inputs are all in ``have``."""
    out: Values = {}
    for name, fn, by, labels in _metrics(level, have):
        if by == "env":
            out[name] = {(env,): fn(fe) for env, fe in per_env}
        elif by == "detector":
            out[name] = {(env, d): fn(fe, d) for d in detectors for env, fe in per_env}
        elif by:
            out[name] = {label: fn(f, k) for k, label in labels}
        else:
            out[name] = {(): fn(f)}
    return out


@plan()
def _token_inputs(mismatch: bool, lag: bool) -> frozenset[str]:
    """The token-level inputs present: "tokens" (always) and those on."""
    return frozenset(name for name, on in (("tokens", True), ("mismatch", mismatch), ("lag", lag)) if on)


def finish_tokens(v: list[float], pos: dict[str, Any], mismatch: bool, lag: bool) -> Values:
    """:data:`~.tokens.METRICS` of the inputs present, from the fused vector ``v`` (positions ``pos``)."""
    return _apply("tokens", _token_inputs(mismatch, lag), fields(v, pos))


# --- episodes ---------------------------------------------------------------------------------------

class GroupBlock(NamedTuple):
    """The group block of the episode matrix: ``rows`` in the matrix's order, ``terms`` (those with a term)
    then ``kinds`` (the threshold rows); ``at``, the position of each kind's threshold in
    :data:`~.groups.GROUP_THRESHOLDS`, and ``index``, those positions as an index of the threshold vector
    (None: the whole vector)."""

    rows: tuple[GroupRow, ...]
    terms: tuple[GroupRow, ...]
    kinds: tuple[GroupRow, ...]
    at: tuple[int, ...]
    index: list[int] | None


@plan(lambda: (q.GROUP_ROWS,))
def group_block() -> GroupBlock:
    """The :class:`GroupBlock` of the declared group rows. Read-only."""
    terms = tuple(row for row in q.GROUP_ROWS if row.term is not None)
    kinds = tuple(row for row in q.GROUP_ROWS if row.term is None)
    at = tuple(q.GROUP_THRESHOLDS.index(row.at) for row in kinds)
    return GroupBlock(terms + kinds, terms, kinds, at,
                      None if at == tuple(range(len(q.GROUP_THRESHOLDS))) else list(at))


@plan()
def _episode_inputs(rewards: bool, groups: bool, envs: bool, truncated: bool) -> frozenset[str]:
    """The episode-level inputs present: "episodes" (always) and those on (groups only with rewards)."""
    return frozenset(name for name, on in (("episodes", True), ("rewards", rewards), ("groups", rewards and groups),
                                           ("envs", envs), ("truncated", truncated)) if on)


@plan(lambda: (q.EPISODE_ROWS, q.GROUP_ROWS))
def episode_rows(rewards: bool, groups: bool, envs: bool,
                 truncated: bool) -> tuple[list[EpisodeRow | GroupRow], list[EpisodeRow], int]:
    """The rows a step computes, in the matrix's order after the ``hacked`` rows (the episode rows
    summed per environment, the others, then :func:`group_block`); the episode rows in declaration
    order (a term may read an earlier row); and how many are summed per environment."""
    have = _episode_inputs(rewards, groups, envs, truncated)
    rows = [row for row in q.EPISODE_ROWS if _needed(row.needs, have)]
    block = list(group_block().rows) if "groups" in have else []
    return sorted(rows, key=lambda row: not row.per_env) + block, rows, sum(row.per_env for row in rows)


class EpisodeLayout(NamedTuple):
    """Positions in :func:`.episodes.episode_core`'s output: ``rows`` (the row names: ``hacked/<detector>``,
    then :func:`episode_rows`), ``max_rows`` (their maxima's names), ``have`` (the inputs), ``width`` (rows
    summed per environment), then slices of the output: ``sums`` [K], ``maxes`` [K], ``range`` (highest
    reward, -lowest; None without groups), ``quantiles`` (the two order statistics around each length
    quantile),
    ``env`` ([E', width] row-major); ``size`` (the block's length)."""

    rows: list[str]
    max_rows: list[str]
    have: frozenset[str]
    width: int
    sums: slice
    maxes: slice
    range: slice | None
    quantiles: slice
    env: slice
    size: int


def episode_layout(rewards: bool, groups: bool, envs: int, truncated: bool, detectors: list[str]) -> EpisodeLayout:
    """The :class:`EpisodeLayout` of a step with these inputs (``envs`` = E', the rows of the
    per-environment sums; 0 without environments). Read-only."""
    return _episode_layout(rewards, groups, envs, truncated, tuple(detectors))


@plan(lambda: (q.EPISODE_ROWS, q.GROUP_ROWS))
def _episode_layout(rewards: bool, groups: bool, envs: int, truncated: bool,
                    detectors: tuple[str, ...]) -> EpisodeLayout:
    declared, _, per_env = episode_rows(rewards, groups, envs > 0, truncated)
    rows = ["hacked/" + d for d in detectors] + [row.name for row in declared]
    K, have = len(rows), _episode_inputs(rewards, groups, envs > 0, truncated)
    width = len(detectors) + per_env if envs else 0
    at, value_range = 2 * K, None
    if "groups" in have:
        value_range, at = slice(at, at + 2), at + 2
    quantiles, at = slice(at, at + 2 * len(q.LENGTH_QUANTILES)), at + 2 * len(q.LENGTH_QUANTILES)
    env, at = slice(at, at + envs * width), at + envs * width
    return EpisodeLayout(rows, ["max_" + row for row in rows], have, width, slice(0, K), slice(K, 2 * K),
                         value_range, quantiles, env, at)


def _episode_fields(names: list[str], sums: list[float], detectors: list[str], **more: Any) -> SimpleNamespace:
    """The rows' sums by name, and by detector those of the ``hacked/<detector>`` rows (the first)."""
    return SimpleNamespace(**dict(zip(names, sums)), hacked=dict(zip(detectors, sums)), **more)


def finish_episodes(v: list[float], pos: EpisodeLayout, envs: list[str], detectors: list[str],
                    reward_bounds: tuple[float, float] | None = None) -> Values:
    """:data:`~.episodes.EPISODE_METRICS` of the inputs present, from :func:`.episodes.episode_core`'s vector
    ``v`` laid out as ``pos`` says (``reward_bounds``: the configured (fail, pass) rewards, None when
    inferred per batch)."""
    names, width, env = pos.rows, pos.width, v[pos.env]
    f = _episode_fields(names, v[pos.sums], detectors, **dict(zip(pos.max_rows, v[pos.maxes])),
                        range=v[pos.range] if pos.range is not None else None, quantiles=v[pos.quantiles],
                        bounds=reward_bounds)
    per_env = [(name, _episode_fields(names[:width], env[e * width:(e + 1) * width], detectors))
               for e, name in enumerate(envs)]
    out = _apply("episodes", pos.have, f, per_env, detectors)
    derive_hack_ratios(out)
    return out
