"""What the signals are computed against: :class:`SignalConfig` (the user's thresholds), the size
limits that choose between the exact and the histogram quantiles and the eager chunk size (read at
call time as ``settings.NAME``, so a test can change them), and the
:class:`Workspace` of reused scratch buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Lag percentiles and the lag mean are exact up to this many updates; larger lags count as this
# many (the maximum stays exact).
LAG_EXACT_MAX = 4095
LAG_BINS = LAG_EXACT_MAX + 1            # the lag histogram's bins: lags 0 .. LAG_EXACT_MAX

SAFETY_BOUND = 20.0  # |r| clamp before exp, as verl's rollout_corr_helper.SAFETY_BOUND

# Up to this many [B, T] positions per step, |r| quantiles are exact (one sort): on CPU a sort is
# cheaper than the histogram's fixed 16k bins below about 10k positions (measured side by side).
EXACT_QUANTILE_MAX_TOKENS = 8192


# Eagerly, the fused function runs over chunks of whole sequences of at most this many [B, T]
# positions, so that a large step holds a chunk's intermediates at a time, never the step's (compiled,
# inductor writes no per-position matrix and one chunk serves every size).
FUSED_CHUNK_TOKENS = 262144
# CPU chunks of up to this many positions stack the sums of each kind into one [k, B, T] group (fewer
# operations); larger ones take one term at a time, comparisons written as 0/1 floats (a boolean
# result is several times slower to write on CPU).
STACK_MAX_TOKENS = 4096


@dataclass(frozen=True)
class SignalConfig:
    """Thresholds the signals are computed against.

    staleness_bound: lag (policy updates) above which a token counts as over-stale.
    is_cap: truncated-IS cap C; tokens with w > C are truncated, w < 1/C counted as low.
    mis_band: masked-IS band [low, high]; tokens with w outside it are masked.
    reward_bounds: (fail, pass) rewards that classify constant groups; inferred per batch if None.
    group_size: expected episodes per group (e.g. num_generations), checked when given.
    """

    staleness_bound: float = 4.0
    is_cap: float = 2.0
    mis_band: tuple[float, float] = (0.5, 5.0)
    reward_bounds: tuple[float, float] | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        if not self.is_cap > 1.0:
            raise ValueError(f"is_cap must be > 1, got {self.is_cap}")
        low, high = self.mis_band
        if not 0.0 < low < 1.0 < high:
            raise ValueError(f"mis_band must satisfy 0 < low < 1 < high, got {self.mis_band}")
        if self.staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {self.staleness_bound}")


class Workspace:
    """Scratch buffers reused across steps, keyed by name.

    A fresh multi-megabyte CPU tensor page-faults on first touch, which costs more than the
    arithmetic on it; reusing buffers of the same shape makes every step after the first allocate
    nothing. One workspace belongs to one caller at a time (``Watch`` holds a lock). ``compile``
    chooses whether the token signals run compiled (see :mod:`rlwatch.signals.engine`).
    """

    def __init__(self, compile: str | None = None) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.compile = compile       # "auto" (also None), "always" or "never" (the Watch passes RLWATCH_COMPILE)
        self.compiled_steps = 0      # steps whose token signals ran as compiled code

    def get(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if (buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != device
                or buf.is_inference() and not torch.is_inference_mode_enabled()):
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf

