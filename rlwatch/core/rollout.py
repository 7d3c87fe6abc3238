"""The rollout system's inputs of a step: episode durations, phase seconds and the launched episodes
that were not trained (docs/rollout-system.md), validated for the record; and :class:`PhaseClock`,
which times a custom loop's phases for ``Watch.phase``.

Durations become a [B] float64 tensor on the mask's device (NaN: unknown); phases a dict of host
floats; the dropped episodes host labels (reason, environment) plus [D] float64 tensors. No host
synchronisation here: the signals read the tensors in the step's one transfer.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from ..signals.buckets import DROP_REASONS

if TYPE_CHECKING:       # torch is imported where tensors are made: the Ray-actor integrations import PhaseClock
    import torch

    from ..signals.inputs import Dropped, RolloutInputs

#: A drop reason outside :data:`~rlwatch.signals.buckets.DROP_REASONS` counts as this one.
OTHER_REASON = DROP_REASONS[-1]


def _seconds_tensor(value: Any, n: int, device: torch.device) -> torch.Tensor:
    """[n] float64 from a tensor, array or list (None entries: NaN); negative and infinite values NaN.
    Raises ValueError on a wrong length or TypeError on an unconvertible value."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(-1)
    else:
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        t = torch.tensor([math.nan if x is None else float(x) for x in items], dtype=torch.float64)
    if t.numel() != n:
        raise ValueError(f"{t.numel()} values for {n} episodes")
    t = t.to(device=device, dtype=torch.float64, non_blocking=True)
    return torch.where((t >= 0) & (t < math.inf), t, torch.full_like(t, math.nan))


def episode_durations(fields: Any) -> Any:
    """``fields.durations``, or the ``duration`` of every episode of ``fields.episodes`` when the
    field is not given and each episode states one (``Episode.duration`` or a mapping's ``duration``)."""
    if fields.durations is not None or not fields.episodes:
        return fields.durations
    try:
        out = [ep.get("duration") if isinstance(ep, Mapping) else getattr(ep, "duration", None)
               for ep in fields.episodes]
    except TypeError:
        return None
    return out if out and all(d is not None for d in out) else None


class RolloutParser:
    """Validates the rollout fields; a bad one is reported through ``bad(field, kind, message)`` and
    dropped (the rest of the step is kept)."""

    def __init__(self, bad: Callable[[str, str, str], None], env_label: Callable[[list[Any]], list[str]],
                 phase_label: Callable[[Any], str] = str) -> None:
        self._bad = bad
        self._env_label = env_label     # raw environment values -> capped labels (the run's registry)
        self._phase_label = phase_label     # a phase name -> its capped label (the run's registry)

    def parse(self, fields: Any, B: int, device: torch.device) -> RolloutInputs:
        from ..signals.inputs import RolloutInputs

        out = RolloutInputs()
        durations = episode_durations(fields)
        if durations is not None:
            out.durations = self._tensor("durations", durations, B, device)
        if fields.phases is not None:
            out.phases = self._phases(fields.phases)
        if fields.dropped_reasons is not None:
            out.dropped = self._dropped(fields, device)
        return out

    def _tensor(self, name: str, value: Any, n: int, device: torch.device) -> torch.Tensor | None:
        try:
            return _seconds_tensor(value, n, device)
        except ValueError as exc:
            self._bad(name, "shape", str(exc))
        except (TypeError, RuntimeError) as exc:
            self._bad(name, "type", f"cannot convert to numbers: {exc}")
        return None

    def _phases(self, value: Any) -> dict[str, float]:
        if not isinstance(value, Mapping):
            self._bad("phases", "type", f"expected a mapping phase -> seconds, got {type(value).__name__}")
            return {}
        out: dict[str, float] = {}
        for name, seconds in value.items():
            try:
                s = float(seconds)
            except (TypeError, ValueError):
                self._bad("phases", "type", f"phase {str(name)[:40]!r}: not a number")
                continue
            if not (math.isfinite(s) and s >= 0):
                self._bad("phases", "value", f"phase {str(name)[:40]!r}: {s} is not a finite duration")
                continue
            label = self._phase_label(name)
            out[label] = out.get(label, 0.0) + s        # phases past the cap add up in ``other``
        return out

    def _dropped(self, fields: Any, device: torch.device) -> Dropped | None:
        value = fields.dropped_reasons
        try:
            items = [value] if isinstance(value, str) else list(value)
        except TypeError:
            self._bad("dropped_reasons", "type", f"expected [D] reasons, got {type(value).__name__}")
            return None
        reasons = [r if r in DROP_REASONS else OTHER_REASON for r in (str(x) for x in items)]
        D = len(reasons)
        env_raw = fields.dropped_env
        if env_raw is None or isinstance(env_raw, str):
            env_raw = [env_raw or "default"] * D
        env_items = list(env_raw)
        if len(env_items) != D:
            self._bad("dropped_env", "shape", f"{len(env_items)} labels for {D} dropped episodes")
            env_items = ["default"] * D
        from ..signals.inputs import Dropped

        dropped = Dropped(reasons, self._env_label(env_items))
        if D == 0:                              # nothing dropped: the launched means are the trained ones
            import torch

            dropped.durations = dropped.lengths = torch.zeros(0, dtype=torch.float64, device=device)
            return dropped
        if fields.dropped_durations is not None:
            dropped.durations = self._tensor("dropped_durations", fields.dropped_durations, D, device)
        if fields.dropped_lengths is not None:
            dropped.lengths = self._tensor("dropped_lengths", fields.dropped_lengths, D, device)
        return dropped


class PhaseClock:
    """Seconds per phase accumulated by ``with clock.phase(name):`` until :meth:`take` hands them to
    the next observed step. Thread-safe; nested or concurrent phases each count their own time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (``generation``, ``training``, ``sync`` or any name): the next
        observed step exports it as ``rlwatch_phase_seconds{phase}`` (``sync`` also as
        ``rlwatch_weight_sync_seconds``); a step's own ``phases=`` wins for the same name."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: Any, seconds: float) -> None:
        """Add ``seconds`` to phase ``name``; never raises (a name that is not a string, even an
        unhashable one, is timed under its text, checked when the step is observed)."""
        try:
            key = name if isinstance(name, str) else str(name)
        except Exception:  # noqa: BLE001 - a __str__ that raises still times the block
            key = f"<{type(name).__name__}>"
        with self._lock:
            self._seconds[key] = self._seconds.get(key, 0.0) + seconds

    def take(self, given: Any = None) -> Any:
        """The accumulated phases merged under ``given`` (a step's own ``phases``, which win for the
        same name), and the clock emptied; ``given`` itself when nothing was timed."""
        with self._lock:
            timed, self._seconds = self._seconds, {}
        if not timed:
            return given
        if isinstance(given, Mapping):
            timed.update(given)
        return timed
