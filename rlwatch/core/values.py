"""One step's values: ``{metric name: {label values: value}}``, and how two of them combine.

The signals produce a plain dict of this shape (names as in :mod:`rlwatch.core.metrics`; a gauge holds
the step's value, a counter the step's increment, the histogram its per-bucket counts; None where a
value is undefined; names starting with ``_`` are internal checks, not exported). The step pipeline
wraps it in a :class:`StepValues`, which is that same dict with typed access and a merge that follows
each family's kind in the catalogue. What a Watch's ``observe`` returns is a :class:`StepValues`.

Only :mod:`rlwatch.core.metrics` is imported here (no torch): the run store, the post-mortem and the
alert rules read values of this shape without the signals.
"""

from __future__ import annotations

from typing import Mapping

from .metrics import BY_NAME

Labels = tuple[str, ...]
Family = dict[Labels, "float | None"]
#: The plain shape, as the signals produce it and the run store gives it back.
Values = dict[str, Family]
#: Kinds whose per-step values are increments: merging two steps' worth adds them.
ADDITIVE_KINDS = frozenset({"counter", "histogram"})


def value_of(values: Mapping[str, Mapping[Labels, float | None]], name: str, labels: Labels = ()) -> float | None:
    """One series' value in any mapping of this shape (a live step, a stored one); None when absent."""
    family = values.get(name)
    return None if family is None else family.get(tuple(labels))


def kind_of(name: str) -> str | None:
    """The catalogue kind of a value family (``counter``, ``gauge``, ...), None for internal names.

    A histogram's ``<name>_sum`` is that histogram's increment too, so it counts as a counter."""
    spec = BY_NAME.get(name)
    if spec is None and name.endswith("_sum"):
        base = BY_NAME.get(name[:-len("_sum")])
        return "counter" if base is not None and base.kind == "histogram" else None
    return spec.kind if spec is not None else None


class StepValues(dict[str, Family]):
    """One step's values (a dict subclass: every dict use keeps working).

    ``value(name, labels)`` reads one series, ``family(name)`` one family (empty when absent),
    ``set(name, value, labels)`` writes one series, ``merge(other)`` combines another source's values
    for the same step: the increments of counters and histograms are added series by series (an
    undefined side counts as nothing), and every other family (gauges, info, internal checks) is
    replaced by ``other``'s as a whole.
    """

    @classmethod
    def of(cls, values: Mapping[str, Mapping[Labels, float | None]] | None) -> "StepValues":
        """``values`` itself when it is a StepValues already, else a StepValues holding the same
        family dicts (the signals' result is wrapped, not copied)."""
        return values if isinstance(values, cls) else cls(values or {})

    def value(self, name: str, labels: Labels = ()) -> float | None:
        return value_of(self, name, labels)

    def family(self, name: str) -> Family:
        return self.get(name) or {}

    def set(self, name: str, value: float | None, labels: Labels = ()) -> None:
        self.setdefault(name, {})[tuple(labels)] = value

    def merge(self, other: Mapping[str, Mapping[Labels, float | None]] | None) -> "StepValues":
        """Combine ``other`` into these values by catalogue kind (see the class); returns self."""
        for name, family in (other or {}).items():
            if kind_of(name) not in ADDITIVE_KINDS:
                self[name] = dict(family)
                continue
            merged = self.setdefault(name, {})
            for labels, increment in family.items():
                before = merged.get(labels)
                merged[labels] = increment if before is None else before if increment is None else before + increment
        return self
