"""One step's inputs as ``Watch.observe`` takes them, before any check: :class:`StepFields`.

``Watch.observe(step, **fields)`` makes one from its keywords; an integration builds one directly and
hands it to ``Watch.observe_fields``, so that no keyword dict is built and parsed again.
:class:`rlwatch.core.record.RecordBuilder` validates it into a ``StepRecord``. No torch import here: the
Ray-actor integrations import this module in every worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping


@dataclass(eq=False)
class StepFields(Mapping):
    """One step's inputs as ``Watch.observe`` takes them (its docstring gives shapes and units), unchecked.

    Integrations set the attributes directly; :meth:`from_mapping` is the path of
    ``observe(step, **fields)``. It reads as the mapping of the fields that are set (not None), so
    ``observe(step, **fields)`` takes it too. ``episodes`` go to the reward-hack detectors, not into
    the record; ``unknown`` names the keywords that are not fields (the builder reports them)."""

    mask: Any = None
    sampler_logp: Any = None
    trainer_logp: Any = None
    token_version: Any = None
    seq_version: Any = None
    trainer_version: Any = None
    rewards: Any = None
    group_ids: Any = None
    truncated: Any = None
    env: Any = None
    hacked: Any = None
    failed: Any = None
    entropy: Any = None
    updated_logp: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    logprobs_mode: Any = None
    durations: Any = None
    phases: Any = None
    dropped_reasons: Any = None
    dropped_durations: Any = None
    dropped_lengths: Any = None
    dropped_env: Any = None
    episodes: Any = None
    unknown: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any], episodes: bool = True) -> "StepFields":
        """The fields of ``observe``'s keywords; other names (``episodes`` too, unless ``episodes``)
        are kept in ``unknown``."""
        accepted = ACCEPTED if episodes else FIELDS
        return cls(**{k: v for k, v in fields.items() if k in accepted},
                   unknown=tuple(sorted(set(fields) - accepted)))

    def __getitem__(self, name: str) -> Any:
        value = getattr(self, name) if name in ACCEPTED else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name in _ORDER if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


#: What ``observe`` takes besides ``step``, in declaration order: the record's fields and ``episodes``.
_ORDER = tuple(name for name in StepFields.__dataclass_fields__ if name != "unknown")
#: Every field ``observe`` accepts besides ``step``.
ACCEPTED = frozenset(_ORDER)
#: The record's fields: what ``observe`` accepts besides the reward-hack detectors' ``episodes``.
FIELDS = ACCEPTED - {"episodes"}


def tensor_bytes(fields: Mapping[str, Any]) -> int:
    """Bytes held by the tensors (and arrays) of an observed step's fields, one level of nesting."""
    total = 0
    for value in fields.values():
        items = value.values() if isinstance(value, Mapping) else (value,)
        for item in items:
            if hasattr(item, "element_size") and hasattr(item, "numel"):
                try:
                    total += item.element_size() * item.numel()
                except Exception:  # noqa: BLE001
                    pass
            elif isinstance(getattr(item, "nbytes", None), int):
                total += item.nbytes
    return total
