"""Reward-hack detectors: the episode they judge, the verdict they return, and the registry.

A detector is a named function of one :class:`Episode` returning a verdict: ``True``/``False``
(optionally as ``(hacked, reason)`` or a :class:`Verdict`), or ``None`` when it does not apply to
that episode (missing data): such episodes are not counted as judged. Register once::

    @rlwatch.hacks.detector("empty_answer", envs={"math"}, sample_rate=1.0)
    def empty_answer(ep):
        return ep.reward > 0 and not (ep.response or "").strip()

An expensive detector (an LLM judge) takes ``sample_rate=0.05``; the hack rate is then measured
over the judged 5% (``rlwatch_episodes_judged_total``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping


@dataclass
class Episode:
    """One episode as a detector sees it. ``extra`` carries whatever the trainer has: tool calls,
    files touched, a diff, commands, test results, reward components, an independent checker's
    verdict (``true_pass``). ``duration`` (seconds) fills the step's ``durations`` when that field is not
    passed and every episode has one."""

    env: str = "default"
    reward: float = 0.0
    prompt: str | None = None
    response: str | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    index: int | None = None
    duration: float | None = None     # wall seconds from launch to finish (the rollout-system signals)

    @classmethod
    def coerce(cls, value: "Episode | Mapping[str, Any]", step: int | None = None, index: int | None = None,
               env: str | None = None) -> "Episode":
        if isinstance(value, Episode):
            ep = value
        else:
            known = {f for f in cls.__dataclass_fields__}
            data = dict(value)
            extra = dict(data.pop("extra", {}) or {})
            extra.update({k: data.pop(k) for k in list(data) if k not in known})
            ep = cls(**data, extra=extra)
            for text, ids in (("response", "response_ids"), ("prompt", "prompt_ids")):
                if getattr(ep, ids) is None and isinstance(getattr(ep, text), (list, tuple)):
                    setattr(ep, ids, list(getattr(ep, text)))      # token ids passed as the text field
                    setattr(ep, text, None)
        if step is not None and ep.step is None:
            ep.step = step
        if index is not None and ep.index is None:
            ep.index = index
        if env is not None and (ep.env in (None, "default")):
            ep.env = env
        return ep


@dataclass(frozen=True)
class Verdict:
    hacked: bool
    reason: str = ""


def as_verdict(result: Any) -> Verdict | None:
    """Normalise a detector's return value; None means "does not apply"."""
    if result is None:
        return None
    if isinstance(result, Verdict):
        return result
    if isinstance(result, tuple):
        hacked, reason = (result + ("",))[:2]
        return None if hacked is None else Verdict(bool(hacked), str(reason))
    return Verdict(bool(result))


@dataclass
class Detector:
    name: str
    fn: Callable[[Episode], Any]
    envs: frozenset[str] | None = None
    sample_rate: float = 1.0
    timeout: float = 5.0

    def applies_to(self, env: str) -> bool:
        return self.envs is None or env in self.envs


REGISTRY: dict[str, Detector] = {}


def register(name: str, fn: Callable[[Episode], Any] | None = None, *, envs: Iterable[str] | None = None,
             sample_rate: float = 1.0, timeout: float = 5.0, replace: bool = True) -> Any:
    """Register a detector (usable as a decorator when ``fn`` is omitted). Returns the Detector."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")

    def add(func: Callable[[Episode], Any]) -> Detector:
        if name in REGISTRY and not replace:
            raise ValueError(f"a detector named {name!r} is already registered")
        det = Detector(name, func, frozenset(envs) if envs is not None else None, sample_rate, timeout)
        REGISTRY[name] = det
        return det

    if fn is not None:
        return add(fn)

    def decorate(func: Callable[[Episode], Any]) -> Callable[[Episode], Any]:
        add(func)
        return func
    return decorate


detector = register


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)


def resolve(detectors: Iterable[Detector | str] | None) -> list[Detector]:
    """Detectors by name or object; None means every registered detector."""
    if detectors is None:
        return list(REGISTRY.values())
    out = []
    for d in detectors:
        if isinstance(d, Detector):
            out.append(d)
        elif d in REGISTRY:
            out.append(REGISTRY[d])
        else:
            raise KeyError(f"no hack detector named {d!r} (registered: {', '.join(REGISTRY)})")
    return out
