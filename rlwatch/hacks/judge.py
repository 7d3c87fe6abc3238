"""Judging one step's episodes: run every applicable detector, count verdicts, keep examples.

Shared by :class:`~rlwatch.hacks.monitor.HackMonitor` (its thread worker) and the detector process
:mod:`rlwatch.hacks.worker`; it imports neither, so the two never import each other.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from .registry import Detector, Episode, as_verdict

EXAMPLE_CHARS = 400


@dataclass
class Example:
    step: int | None
    env: str
    detector: str
    reason: str
    prompt: str
    response: str
    reward: float


def _text(ep: Episode, which: str) -> str:
    text = getattr(ep, which)
    if text is None:
        ids = getattr(ep, f"{which}_ids")
        text = " ".join(map(str, ids)) if ids is not None else ""
    return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "…"


def sampled(detector: Detector, ep: Episode) -> bool:
    """Deterministic sampling: the same episode is judged or skipped on every replay."""
    if detector.sample_rate >= 1.0:
        return True
    key = f"{detector.name}|{ep.step}|{ep.index}|{ep.env}".encode()
    return (zlib.crc32(key) / 2**32) < detector.sample_rate


@dataclass
class BatchResult:
    """What the detectors found in one step's episodes (``step``: the step they came from)."""

    step: int | None = None
    judged: dict[tuple[str, str], float] = field(default_factory=dict)
    hacked: dict[tuple[str, str], float] = field(default_factory=dict)
    errors: list[tuple[str, str]] = field(default_factory=list)       # (kind, message)
    examples: list[Example] = field(default_factory=list)


def judge_batch(detectors: list[Detector], step: int, raw: list[Any], env: list[str] | None,
                max_examples: int = 20, cooperative: bool = False) -> BatchResult:
    """Run every applicable detector on one step's episodes. ``cooperative`` yields the GIL after
    each call (the thread worker shares it with the training loop)."""
    result = BatchResult(step=step)
    try:
        batch = [Episode.coerce(ep, step=step, index=i, env=env[i] if env and i < len(env) else None)
                 for i, ep in enumerate(raw)]
    except Exception as exc:  # noqa: BLE001
        result.errors.append(("episodes", f"cannot read episodes: {exc}"))
        return result
    for det in detectors:
        for ep in batch:
            if not (det.applies_to(ep.env) and sampled(det, ep)):
                continue
            start = time.perf_counter()
            try:
                verdict = as_verdict(det.fn(ep))
            except Exception as exc:  # noqa: BLE001 - a detector's bug is its own error kind, not "honest"
                result.errors.append(("detector_error", f"{det.name}: {type(exc).__name__}: {exc}"))
                continue
            finally:
                if cooperative:
                    time.sleep(0)
            if time.perf_counter() - start > det.timeout:
                result.errors.append(("detector_timeout", f"{det.name} took over its {det.timeout}s budget on "
                                                          "an episode; verdict discarded"))
                continue
            if verdict is None:
                continue
            key = (ep.env, det.name)
            result.judged[key] = result.judged.get(key, 0.0) + 1
            if verdict.hacked:
                result.hacked[key] = result.hacked.get(key, 0.0) + 1
                if len(result.examples) < max_examples:
                    result.examples.append(Example(ep.step, ep.env, det.name, verdict.reason, _text(ep, "prompt"),
                                                   _text(ep, "response"), ep.reward))
    return result


def _clean_keys(counts: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """(env, detector) keys as label-safe strings (a detector's name is the user's string)."""
    from ..core.record import clean_text

    out: dict[tuple[str, str], float] = {}
    for key, n in counts.items():
        clean = tuple(clean_text(part) for part in key)
        out[clean] = out.get(clean, 0.0) + n
    return out
