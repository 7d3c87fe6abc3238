"""Tensor helpers the integrations share: a step's micro-batches concatenated, per-sample policy
versions, and the reward-hack detectors' episodes of a step."""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["episode_dicts", "pad_cat", "version_pairs"]


def episode_dicts(fields: Any, extras: list[dict], response_ids: list | None = None) -> list[dict[str, Any]]:
    """One reward-hack detector episode per sample of a step's ``StepFields``: environment
    ("default" without labels), reward (0.0 without rewards), truncation (False without flags), the
    per-sample ``extras[i]`` and, where known, ``response_ids[i]``."""
    B = int(fields.mask.shape[0])
    rewards = fields.rewards.double().cpu().tolist() if fields.rewards is not None else [0.0] * B
    env = fields.env or ["default"] * B
    truncated = fields.truncated.tolist() if fields.truncated is not None else [False] * B
    out = []
    for i in range(B):
        episode = {"env": str(env[i]), "reward": rewards[i], "truncated": bool(truncated[i]), "extra": extras[i]}
        if response_ids is not None and response_ids[i] is not None:
            episode["response_ids"] = response_ids[i]
        out.append(episode)
    return out


def pad_cat(tensors: list[Any], width: int) -> Any:
    """Concatenate [b_i, T_i] tensors along the batch, right-padding narrower ones to ``width`` with
    zeros (a wider one is left as it is, for the record's validation to report)."""
    import torch

    padded = [t if t.shape[1] >= width else torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
    return padded[0] if len(padded) == 1 else torch.cat(padded)


def version_pairs(first: Iterable[Any], last: Iterable[Any]) -> Any:
    """[B, 2] int64 (first, last) policy versions per sample, or None when any sample lacks one."""
    import torch

    first, last = list(first), list(last)
    if not first or any(v is None for v in first) or any(v is None for v in last):
        return None
    return torch.tensor([[int(a), int(b)] for a, b in zip(first, last)], dtype=torch.int64)
