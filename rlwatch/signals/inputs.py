"""What the signals read of one step: a :class:`StepRecord`, validated by :mod:`rlwatch.core.record`
(and its rollout part by :mod:`rlwatch.core.rollout`) before it reaches them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Dropped:
    """Launched episodes of a step that were not trained: D of them."""

    reasons: list[str]                              # [D], each in buckets.DROP_REASONS
    env: list[str]                                  # [D] capped environment labels
    durations: torch.Tensor | None = None           # [D] float64 seconds, NaN unknown
    lengths: torch.Tensor | None = None             # [D] float64 tokens, NaN unknown

    @property
    def count(self) -> int:
        return len(self.reasons)


@dataclass
class RolloutInputs:
    """The validated rollout-system fields of one step."""

    durations: torch.Tensor | None = None           # [B] float64 seconds on the mask's device, NaN unknown
    phases: dict[str, float] = field(default_factory=dict)
    dropped: Dropped | None = None


@dataclass
class StepRecord:
    """A validated step. Tensors live on ``mask.device``; ``mask`` is float 0/1 [B, T]."""

    step: int
    mask: torch.Tensor
    sampler_logp: torch.Tensor | None = None
    trainer_logp: torch.Tensor | None = None
    version: torch.Tensor | None = None            # [B, T], [B] or [B, 2]
    trainer_version: int | None = None
    rewards: torch.Tensor | None = None            # [B] float
    group_ids: torch.Tensor | None = None          # [B] int64
    truncated: torch.Tensor | None = None          # [B] bool
    env: list[str] | None = None                   # [B] capped labels
    env_index: torch.Tensor | None = None          # [B] int64 into env_names
    env_names: list[str] = field(default_factory=list)
    hacked: dict[str, torch.Tensor] = field(default_factory=dict)   # detector -> [B] bool
    failed: list[str | None] | None = None
    entropy: torch.Tensor | None = None
    updated_logp: torch.Tensor | None = None       # [B, T] the tokens' log-probs after the update
    sampling: dict[str, Any] = field(default_factory=dict)
    rollout: RolloutInputs = field(default_factory=RolloutInputs)   # durations, phases, dropped episodes

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])
