"""Device tensors waiting for the step's single host transfer, and the NaN policy of the host formulas."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

#: One step's signals: ``{metric name: {label values: value}}``; None where a value is undefined.
Values = dict[str, dict[tuple[str, ...], "float | None"]]


class Pending:
    """Device tensors waiting for the step's single host transfer, and the host formulas that finish
    them.

    ``derive(name, fn, *parts)`` a reduction whose final
    formula (a ratio, a variance) runs on the host in float64 after the transfer; ``host(fn, *parts)``
    a formula returning several families at once (the fused vector's). Each 0-d part reaches ``fn``
    as a float, each 1-d part (:meth:`vector`) as a list, anything else unchanged. On small batches a
    formula on 0-d device tensors costs more than the reductions themselves. ``resolve()`` returns
    ``{name: {labels: float | None}}``; NaN, infinities and a formula's division by zero resolve to None.
    """

    def __init__(self) -> None:
        self._scalars: list[torch.Tensor] = []       # 0-d parts, stacked for the transfer
        self._vectors: list[torch.Tensor] = []       # 1-d parts, concatenated after the scalars
        self._entries: list[tuple[str, Any, Callable[..., Any] | None, tuple[Any, ...]]] = []

    def _part(self, value: Any) -> Any:
        if isinstance(value, _Slot):                 # already registered with :meth:`vector`
            return value
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                self._scalars.append(value)
                return _Slot(len(self._scalars) - 1, None)
            self._vectors.append(value if value.dim() == 1 else value.reshape(-1))
            return _Slot(len(self._vectors) - 1, value.numel())
        return value

    def vector(self, values: torch.Tensor) -> Any:
        """Register a 1-d tensor once; the returned handle can be a part of any number of entries."""
        return self._part(values.reshape(-1) if values.dim() != 1 else values)

    def host(self, fn: Callable[..., "Values"], *parts: Any) -> None:
        """``fn(*parts)`` on the host returns several ``{name: {labels: value}}`` families at once."""
        self._entries.append(("", None, fn, tuple(self._part(p) for p in parts)))

    def derive(self, name: str, fn: Callable[..., float | None], *parts: Any, labels: tuple[str, ...] = ()) -> None:
        self._entries.append((name, labels, fn, tuple(self._part(p) for p in parts)))

    def ratio(self, name: str, num: Any, den: Any, labels: tuple[str, ...] = ()) -> None:
        """num / den on the host; None when den is 0."""
        self.derive(name, _div, num, den, labels=labels)

    def resolve(self) -> dict[str, dict[tuple[str, ...], float | None]]:
        # Scalars are stacked per dtype: stacking mixed dtypes is several times slower.
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(self._scalars):
            groups.setdefault((t.dtype, t.device), []).append(i)
        tensors = [torch.stack([self._scalars[i] for i in members]) for members in groups.values()]
        tensors += self._vectors
        if not tensors:
            return {}
        if len({t.device for t in tensors}) > 1:
            tensors = [t.cpu() for t in tensors]
        host = (torch.cat(tensors) if len(tensors) > 1 else tensors[0]).to(torch.float64).tolist()  # the one sync
        position = [0] * len(self._scalars)
        for at, i in enumerate(i for members in groups.values() for i in members):
            position[i] = at
        offsets, at = [], len(self._scalars)
        for v in self._vectors:
            offsets.append(at)
            at += v.numel()

        def value(part: Any) -> Any:
            if not isinstance(part, _Slot):
                return part
            if part.size is None:
                return host[position[part.index]]
            start = offsets[part.index]
            return host[start:start + part.size]

        out: dict[str, dict[tuple[str, ...], float | None]] = {}
        for name, labels, fn, parts in self._entries:
            args = [value(p) for p in parts]
            if labels is None:                      # a host() entry: several families at once
                for family_name, rows in fn(*args).items():
                    for row, v in rows.items():
                        if v is not None and not math.isfinite(v):
                            rows[row] = None
                    out[family_name] = out[family_name] | rows if family_name in out else rows
                continue
            out.setdefault(name, {})[labels] = _finite(_apply(fn, args))
        return out


class _Slot(NamedTuple):
    index: int
    size: int | None          # None for a scalar


def _apply(fn: Callable[..., Any], args: list[Any]) -> Any:
    try:
        return fn(*args)
    except (ZeroDivisionError, ValueError, OverflowError):
        return None


def _finite(v: Any) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _div(num: float, den: float) -> float | None:
    """num / den on the host; None when den is 0. Every denominator here counts the items its
    numerator sums over, so an empty set has no value."""
    return num / den if den else None

