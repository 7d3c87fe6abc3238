"""The OpenRLHF integration's reading of one training step: the ``Experience`` batches that
``make_experience_batch`` returns, with the stamps of their samples, as the step's fields, agent
extra-log scalars and the hack detectors' episodes."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ...core.fields import StepFields
from .._ray_actors import config_get
from .._tensors import episode_dicts, pad_cat, version_pairs

# --- turning Experiences into one observe() ------------------------------------------------------

def _tokens(experiences: list[Any], name: str, width: int) -> Any:
    """The [b_i, A_i] attribute ``name`` of every Experience, copied to the host as one [B, width] tensor."""
    import torch

    return pad_cat([torch.atleast_2d(getattr(e, name).detach()).to("cpu", copy=True) for e in experiences], width)


def fields_from_experiences(experiences: list[Any], metas: list[dict | None], args: Any,
                            trainer_version: int | None = None, clock_id: str | None = None
                            ) -> tuple[StepFields | None, dict[str, float]]:
    """(the step's fields, agent extra-log scalars) for one training step; None without experiences.

    ``experiences``: what ``make_experience_batch`` returned (micro-batches of samples, each
    ``[b, A_i]``, right-padded to different widths); ``metas[i]``: the stamp of
    ``rollout_samples[i]``, which OpenRLHF's ``Experience.index`` points back to."""
    import torch

    experiences = [e for e in experiences if getattr(e, "action_mask", None) is not None]
    if not experiences:
        return None, {}
    width = max(int(e.action_mask.shape[-1]) for e in experiences)
    fields = StepFields(mask=_tokens(experiences, "action_mask", width).bool())
    if all(e.action_log_probs is not None for e in experiences):
        fields.trainer_logp = _tokens(experiences, "action_log_probs", width).float()
    if all(e.rollout_log_probs is not None for e in experiences):
        fields.sampler_logp = _tokens(experiences, "rollout_log_probs", width).float()
        fields.logprobs_mode = "processed_logprobs"     # what OpenRLHF asks vLLM for
    if all(e.rewards is not None for e in experiences):
        fields.rewards = torch.cat([e.rewards.detach().reshape(-1).to("cpu") for e in experiences]).double()
    rows = _sample_rows(experiences, metas, args, fields)
    fields.truncated = _truncation(experiences, rows)
    if any(r is not None and r.get("env") for r in rows):
        fields.env = [(r.get("env") if r is not None else None) or "default" for r in rows]
    stamps = [r.get("version") if r is not None else None for r in rows]
    if trainer_version is not None and stamps and all(s is not None for s in stamps):
        if all(r.get("clock") == clock_id for r in rows if r is not None):
            fields.seq_version = version_pairs(*zip(*stamps))
            fields.trainer_version = int(trainer_version)
    sampling = next((r.get("sampling") for r in rows if r is not None and r.get("sampling")), None) or {}
    for key in ("temperature", "top_p", "top_k"):
        value = sampling.get(key)
        if value is not None and not (key == "top_k" and value <= 0):
            setattr(fields, key, value)
    return fields, _extra_logs(experiences, rows)


def _sample_rows(experiences: list[Any], metas: list[dict | None], args: Any, fields: StepFields
                 ) -> list[dict | None]:
    """Each sample's stamp, through ``Experience.index`` (None where it cannot be found); sets the
    group ids (OpenRLHF's own grouping: ``index // n_samples_per_prompt``) in ``fields``."""
    import torch

    index: list[int] = []
    for e in experiences:
        if e.index is None or len(e.index) != int(e.action_mask.shape[0]):
            return [None] * int(fields.mask.shape[0])
        index.extend(int(i) for i in e.index)
    n = int(config_get(args, "rollout.n_samples_per_prompt", 1) or 1)
    if n > 1:
        fields.group_ids = torch.tensor(index, dtype=torch.int64) // n
    return [metas[i] if 0 <= i < len(metas) else None for i in index]


def _truncation(experiences: list[Any], rows: list[dict | None]) -> Any:
    """[B] bool: the stamped finish reason where there is one, else OpenRLHF's ``truncated``."""
    import torch

    truncated = None
    if all(e.truncated is not None for e in experiences):
        truncated = torch.cat([e.truncated.detach().reshape(-1).to("cpu").bool() for e in experiences])
    if any(r is not None and r.get("truncated") is not None for r in rows):
        flags = [bool(r["truncated"]) if r is not None and r.get("truncated") is not None
                 else (bool(truncated[i]) if truncated is not None else False) for i, r in enumerate(rows)]
        truncated = torch.tensor(flags, dtype=torch.bool)
    return truncated


def _info_columns(experiences: list[Any], keys: list[str]) -> dict[str, list[Any]]:
    """Each agent ``extra_logs`` entry in ``keys`` per sample, from ``Experience.info`` (None for the
    samples of a batch whose entry is missing or is not one value per sample)."""
    import torch

    columns: dict[str, list[Any]] = {}
    for key in keys:
        column: list[Any] = []
        for e in experiences:
            v = e.info.get(key) if isinstance(getattr(e, "info", None), Mapping) else None
            b = int(e.action_mask.shape[0])
            column += (v.detach().reshape(-1).to("cpu").tolist() if isinstance(v, torch.Tensor) and v.numel() == b
                       else [None] * b)
        columns[key] = column
    return columns


def _extra_logs(experiences: list[Any], rows: list[dict | None]) -> dict[str, float]:
    """``extra_logs/<name>``: the batch mean of each per-sample agent ``extra_logs`` entry."""
    import torch

    extra: dict[str, float] = {}
    keys = sorted({k for r in rows if r is not None for k in r.get("extra_logs", ())})
    for key, column in _info_columns(experiences, keys).items():
        values = [v for v in column if v is not None]
        if values:
            mean = float(torch.tensor(values, dtype=torch.float64).mean())
            if math.isfinite(mean):
                extra[f"extra_logs/{key}"] = mean
    return extra


def episodes_from_experiences(experiences: list[Any], fields: StepFields, metas: list[dict | None]
                              ) -> list[dict[str, Any]]:
    """One episode per sample for the reward-hack detectors (:func:`~.._tensors.episode_dicts`): response
    token ids, reward, environment, truncation, and the agent's per-sample ``extra_logs`` (an
    independent checker's verdict logged there as ``true_pass`` feeds the ``verifier_disagreement``
    detector)."""
    experiences = [e for e in experiences if getattr(e, "action_mask", None) is not None]
    keys = sorted({k for m in metas if m is not None for k in m.get("extra_logs", ())})
    per_key = _info_columns(experiences, keys)
    ids: list[list[int] | None] = []
    for e in experiences:
        sequences, mask = getattr(e, "sequences", None), e.action_mask.bool()
        if sequences is None:
            ids += [None] * int(mask.shape[0])
            continue
        responses = sequences[:, -mask.shape[1]:].to("cpu")
        ids += [row[m].tolist() for row, m in zip(responses, mask.to("cpu"))]
    extras = [{k: (bool(v[i]) if k == "true_pass" else v[i]) for k, v in per_key.items() if v[i] is not None}
              for i in range(int(fields.mask.shape[0]))]
    return episode_dicts(fields, extras, ids)
