"""The kinds of declaration (:class:`TokenSum`, :class:`SeqSum`, :class:`Metric`, :class:`EpisodeRow`,
:class:`GroupRow`, :class:`Threshold`) and the labels of the ``by`` slices. The declarations themselves are
in the modules of their level (:mod:`.tokens`, :mod:`.sequences`, :mod:`.episodes`, :mod:`.groups`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..buckets import LAG_BUCKET_LABELS, PROB_BIN_LABELS, ZERO_VARIANCE_KINDS
from ..ranges import Ranged

#: Labels of the ``by`` slices.
BY_LABELS: dict[str, tuple[str, ...]] = {"band": PROB_BIN_LABELS, "lag": LAG_BUCKET_LABELS, "kind": ZERO_VARIANCE_KINDS}
#: The label names of a metric's series by its ``by`` (the catalogue entry of a declared metric reads them).
BY_LABEL_NAMES: dict[str, tuple[str, ...]] = {"": (), "band": ("prob_bin",), "lag": ("lag",), "kind": ("kind",),
                                              "env": ("env",), "detector": ("env", "detector")}


@dataclass(frozen=True)
class TokenSum:
    """A sum over the valid tokens of ``term``: as is, ``square``d, counted where ``term`` is ``above``
    or below (``above=False``) the device constant named ``against`` (one of a :class:`Threshold`'s
    ``device`` names), or ``by`` "band"/"lag" (a slice)."""

    name: str
    term: str
    square: bool = False
    against: str = ""
    above: bool = True
    by: str = ""


@dataclass(frozen=True)
class SeqSum:
    """A sum over the sequences with a valid token of a per-sequence term (``has``: 1; ``abs``:
    |s_b|; ``chi2``: exp(2 s_b) - 1, s_b the sum of r over the sequence; ``s``: s_b, only compared
    with the device constant ``against``)."""

    name: str
    term: str
    against: str = ""
    above: bool = True


@dataclass(frozen=True)
class Metric:
    """A catalogue family and its host formula ``fn(f)``, ``f`` the fields by name (:func:`.readers.fields`
    for a token metric; for an episode metric the sums of its rows, see :func:`.readers.finish_episodes`).
    ``needs``: the inputs it needs, joined by "+" ("tokens", "mismatch", "lag"; "episodes",
    "rewards", "groups", "envs", "truncated"). ``by``: one value per label, ``fn(f, k)`` for the
    k-th of :data:`BY_LABELS` ("band", "lag", "kind"); "env": ``fn(f)`` per environment with ``f``
    its sums of the ``per_env`` rows; "detector": ``fn(f, detector)`` per environment and detector.
    ``help`` (what one value is, with its unit: the exposition's HELP) and ``section`` (the catalogue's
    group: ``"mismatch"``, ``"is"``, ``"lag"``, ``"step"``, ``"groups"``, ``"length"``, ``"env"``, ...; it
    gives the family's level, :attr:`rlwatch.core.metrics.MetricSpec.level`): its catalogue entry, which
    :mod:`rlwatch.core.metrics` makes from them: a gauge, a counter when the name ends in ``_total``,
    labelled by ``by``. Both are required: a declaration without them raises ValueError, naming the
    metric, when its module is imported. ``kind``: ``"histogram"`` (one value per bucket of ``by``, exported
    as a Prometheus histogram) or ``"internal"`` (kept in the step's values, no catalogue entry of its
    own: a histogram's ``_sum``); names starting with ``_`` are internal too (checks)."""

    name: str
    fn: Callable[..., float | None]
    needs: str = "mismatch"
    by: str = ""
    help: str = ""
    section: str = ""
    kind: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("", "histogram", "internal"):
            raise ValueError(f"metric {self.name!r}: kind {self.kind!r} is not '', 'histogram' or 'internal'")
        if self.exported and not (self.help.strip() and self.section.strip()):
            missing = " and ".join(k for k in ("help", "section") if not getattr(self, k).strip())
            raise ValueError(f"metric {self.name!r} is declared without {missing}: its catalogue entry is "
                             f"Metric(..., help=..., section=...) (docs/adding-a-signal.md)")

    @property
    def exported(self) -> bool:
        """Whether the family has a catalogue entry (and is exported), made from ``help`` and ``section``."""
        return self.kind != "internal" and not self.name.startswith("_")


@dataclass(frozen=True)
class EpisodeRow:
    """A row of the step's [K, B] per-episode matrix (:func:`rlwatch.signals.episodes.episode_core`), reduced to its
    sum and its maximum. ``term(e)``: the [B] row from the per-episode tensors ``e`` (``all_ok``: not
    failed, ``length``, ``truncated``; with rewards ``ok``: usable (not failed, finite reward), ``r``:
    the reward, 0 where unusable; with groups and environments ``pairs``, ``pairs_zero_var``) and the
    rows declared before it, by name. ``needs``: the inputs it needs ("episodes", always there;
    "rewards", "groups", "envs", "truncated", joined by "+"); ``per_env``: also summed per environment."""

    name: str
    term: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    needs: str = "episodes"
    per_env: bool = False


@dataclass(frozen=True)
class GroupRow:
    """A row of the group block: one value per group slot (one per group id, B + 1 in all), reduced as
    an :class:`EpisodeRow`. ``term(g)``: the row from the per-slot tensors ``g`` (``exists``: a usable
    episode, ``zero_var``: a constant group, ``size``: usable episodes; ``B``, an int); without a term,
    the constant groups whose ``base`` ("ref": the group's reward, "neg": -ref) is >= the threshold of
    :data:`.groups.GROUP_THRESHOLDS` named ``at``."""

    name: str
    term: Callable[[dict[str, Any]], torch.Tensor] | None = None
    base: str = ""
    at: str = ""


@dataclass(frozen=True)
class Threshold(Ranged):
    """A configurable threshold of the signals, declared once. ``name``: its keyword (``SignalConfig``,
    ``WatchConfig``, ``Watch``), its ``RLWATCH_<NAME>`` variable and its config gauge ``rlwatch_<name>``
    (``help``: the gauge's help, default ``doc``); ``doc``: its meaning (the runbook's "Signal
    settings"). The values allowed, as an alert threshold's (:class:`rlwatch.alerts.params.Param`): from
    ``low`` (or strictly above ``above``) to ``high`` (or strictly below ``below``), finite; a value
    outside raises ValueError. ``device``: the named constants the sums compare against (``against=``)
    or a term reads (``t[name]``), each made from the value on the host (float64) when the
    configuration is first used. ``parts``: a threshold of several values (a band), one
    :class:`Threshold` per value, each with its own range and gauge; the keyword takes a tuple, the
    ``device`` functions take the values."""

    name: str
    default: Any = None
    doc: str = ""
    low: float = 0.0
    high: float = math.inf
    above: float | None = None
    below: float | None = None
    device: Mapping[str, Callable[..., float]] = field(default_factory=dict, hash=False, compare=False)
    help: str = ""
    parts: tuple["Threshold", ...] = ()

    @property
    def value(self) -> Any:
        """The default value (a tuple for a threshold of ``parts``)."""
        return tuple(p.value for p in self.parts) if self.parts else self.default

    @property
    def allowed(self) -> str:
        """The values allowed, in interval notation, e.g. ``(1, inf)`` or ``mis_low in (0, 1), ...``."""
        if self.parts:
            return ", ".join(f"{p.name} in {p.allowed}" for p in self.parts)
        return super().allowed

    def check(self, value: Any) -> Any:
        """``value`` as the signals take it (a float, or a tuple of floats for ``parts``); ValueError when it
        is not allowed."""
        try:
            if isinstance(value, bool) or (self.parts and isinstance(value, (str, bytes))):
                raise TypeError(value)
            numbers = tuple(float(v) for v in value) if self.parts else (float(value),)
        except (TypeError, ValueError):
            numbers = ()
        parts = self.parts or (self,)
        if len(numbers) != len(parts) or not all(p.allows(x) for p, x in zip(parts, numbers)):
            raise ValueError(f"{self.name}={value!r} is not allowed: {self.name} must be "
                             f"{'(' + ', '.join(p.name for p in parts) + ') with ' if self.parts else 'a number in '}"
                             f"{self.allowed}")
        return numbers if self.parts else value

    def constants(self, value: Any) -> dict[str, float]:
        """The named device constants of ``value`` (checked)."""
        values = tuple(value) if self.parts else (value,)
        return {name: float(fn(*values)) for name, fn in self.device.items()}

    def gauges(self, value: Any) -> list[tuple[str, float, str]]:
        """(gauge name, value, help) of each config gauge of ``value``."""
        if self.parts:
            return [(p.name, float(v), p.help or p.doc) for p, v in zip(self.parts, value)]
        return [(self.name, float(value), self.help or self.doc)]


def _needed(needs: str, have: set[str]) -> bool:
    return set(needs.split("+")) <= have
