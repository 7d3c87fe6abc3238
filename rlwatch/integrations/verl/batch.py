"""The verl integration's reading of one training step: a ``DataProto`` (v0 trainers and recipes) or
a v1 ``KVBatchMeta`` read from TransferQueue, as the step's fields, and the hack detectors' episodes."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ...core.fields import StepFields
from .._ray_actors import config_get
from .._tensors import episode_dicts, version_pairs

#: Fields read from TransferQueue for the v1 trainer (absent ones are skipped).
V1_FIELDS = ("response_mask", "old_log_probs", "rollout_log_probs", "rm_scores", "entropy", "uid",
             "data_source")

#: The non_tensor_batch key where rlwatch's wrapper of ``AgentLoopManager._performance_metrics`` puts each
#: sample's agent-loop seconds (generate_sequences + tool_calls + compute_score, verl's own per-sample timers).
DURATION_KEY = "rlwatch_episode_seconds"
#: verl's ``timing_raw`` keys -> rlwatch phases; the keys under one phase add up. Keys not listed
#: (``step``, ``testing``, ``save_checkpoint``, ``agent_loop/...``) are not phases of the step.
VERL_PHASES = {"gen": "generation", "update_actor": "training", "update_critic": "training",
               "update_weights": "sync", "reward": "reward", "old_log_prob": "old_logp", "ref": "ref",
               "values": "values", "adv": "adv"}

#: Per-sample finish information, if a rollout puts it in the batch (verl 0.9.1 does not yet).
FINISH_KEYS = ("truncated", "finish_reason", "stop_reason")


def truncation_flags(response_length: Any, prompt_length: Any = None, max_response_length: int | None = None,
                     max_model_len: int | None = None) -> Any:
    """Which responses hit a length cap. Lengths are [B] token counts (tensors); returns [B] bool,
    or None when no cap is known.

    A response is cut when its true length reaches ``rollout.response_length`` or, when
    ``rollout.max_model_len`` is set, ``max_model_len - prompt_length`` (the rollout servers clamp
    ``max_tokens`` to both). verl's ``response_length/clip_ratio`` instead compares the length with
    ``responses.shape[-1]``, the padded width of the batch tensor: the v0 agent loop pads to the
    configured length, so there the two agree, but the v1 trainer pads jagged tensors to the batch
    maximum, so the longest response of every batch counts as clipped even when nothing hit the cap
    (verl#7817), and neither path sees the ``max_model_len`` cap (verl#7823).
    """
    import torch

    length = torch.as_tensor(response_length).to(torch.float64)
    cap = torch.full_like(length, float("inf"))
    known = False
    if max_response_length:
        cap = cap.clamp(max=float(max_response_length))
        known = True
    if max_model_len and prompt_length is not None:
        room = float(max_model_len) - torch.as_tensor(prompt_length, device=length.device).to(torch.float64)
        cap = torch.minimum(cap, room)
        known = True
    return (length >= cap) & (length > 0) if known else None


def _finish_flags(non_tensor: Mapping[str, Any], size: int) -> Any:
    """[B] bool from a per-sample finish reason or truncation flag in the batch, else None."""
    import torch

    for key in FINISH_KEYS:
        values = non_tensor.get(key) if hasattr(non_tensor, "get") else None
        if values is None or len(values) != size:
            continue
        items = list(values.tolist() if hasattr(values, "tolist") else values)
        if key == "truncated":
            return torch.tensor([bool(v) for v in items], dtype=torch.bool)
        return torch.tensor([str(v).lower() == "length" for v in items], dtype=torch.bool)
    return None


def _labels(values: Any) -> list[Any] | None:
    if values is None:
        return None
    items = values.tolist() if hasattr(values, "tolist") else list(values)
    return [str(v) if not isinstance(v, (str, int)) else v for v in items]


def _sampling(config: Any) -> dict[str, Any]:
    out = {}
    for key in ("temperature", "top_p", "top_k"):
        value = config_get(config, f"actor_rollout_ref.rollout.{key}")
        if value is not None:
            out[key] = value
    return out


def _trainer_logp(old: Any, rollout: Any, config: Any) -> Any:
    """old_log_probs unless it is a copy of the sampler's (rollout-correction bypass mode), where
    verl measures no trainer-side recompute and a zero mismatch would be a false reading."""
    import torch

    if old is None:
        return None
    bypass = bool(config_get(config, "algorithm.rollout_correction.bypass_mode", False))
    if rollout is not None and (bypass or old is rollout
                                or (old.shape == rollout.shape and torch.equal(old, rollout))):
        return None
    return old


def fields_from_dataproto(batch: Any, config: Any = None, trainer_version: int | None = None) -> StepFields:
    """The step's fields from a verl ``DataProto`` as ``compute_data_metrics`` receives it.

    Tensors: responses/response_mask/log-probs/scores [B, R]; attention_mask [B, P + R].
    """
    tensors, extra = batch.batch, batch.non_tensor_batch
    present = set(tensors.keys())
    mask = tensors["response_mask"]
    B, R = mask.shape
    if "response_length" in present:
        response_length = tensors["response_length"]
        prompt_length = tensors["prompt_length"] if "prompt_length" in present else None
    elif "attention_mask" in present:
        attention = tensors["attention_mask"]
        response_length = attention[:, -R:].sum(-1)
        prompt_length = attention[:, :-R].sum(-1)
    else:
        response_length, prompt_length = mask.sum(-1), None
    fields = _token_fields(tensors, present, config)
    reward = next((key for key in ("token_level_scores", "token_level_rewards", "rm_scores") if key in present), None)
    if reward is not None:
        fields.rewards = tensors[reward].sum(-1)
    entropy = next((key for key in ("entropys", "entropy") if key in present and tuple(tensors[key].shape) == (B, R)),
                   None)
    if entropy is not None:
        fields.entropy = tensors[entropy]
    versions = None
    if trainer_version is not None and "min_global_steps" in extra and "max_global_steps" in extra:
        versions = version_pairs(extra["min_global_steps"], extra["max_global_steps"])
    return _sample_fields(fields, extra, B, response_length, prompt_length, config, versions, trainer_version)


def _token_fields(tensors: Any, present: set[str], config: Any) -> StepFields:
    """mask, sampler_logp and trainer_logp ([B, R]) from a batch's tensors, and the sampling parameters."""
    rollout = tensors["rollout_log_probs"] if "rollout_log_probs" in present else None
    old = tensors["old_log_probs"] if "old_log_probs" in present else None
    return StepFields(mask=tensors["response_mask"], sampler_logp=rollout,
                      trainer_logp=_trainer_logp(old, rollout, config), **_sampling(config))


def _sample_fields(fields: StepFields, extra: Mapping[str, Any], size: int, response_length: Any,
                   prompt_length: Any, config: Any, versions: Any, trainer_version: int | None) -> StepFields:
    """``fields`` completed with what both batch layouts give per sample (groups, environments,
    truncation, aborted samples, versions)."""
    import torch

    fields.group_ids = _labels(extra.get("uid"))
    fields.env = _labels(extra.get("data_source"))
    fields.truncated = _truncated(extra, size, response_length, prompt_length, config)
    fields.failed = ["aborted" if n == 0 else None for n in torch.as_tensor(response_length).tolist()]
    if versions is not None and trainer_version is not None:
        fields.seq_version, fields.trainer_version = versions, trainer_version
    if DURATION_KEY in extra:
        fields.durations = [float(x) for x in extra[DURATION_KEY]]
    return fields


def phases_from_timing(timing_raw: Any) -> dict[str, float] | None:
    """The step's phases (seconds) from verl's ``timing_raw`` (``marked_timer`` blocks; ``VERL_PHASES``)."""
    if not isinstance(timing_raw, Mapping):
        return None
    phases: dict[str, float] = {}
    for key, phase in VERL_PHASES.items():
        if isinstance(timing_raw.get(key), (int, float)):
            phases[phase] = phases.get(phase, 0.0) + float(timing_raw[key])
    return phases or None


def episode_seconds(metrics: Iterable[Iterable[Mapping[str, Any]]]) -> list[float]:
    """Each sample's agent-loop seconds, in the output's order, from ``AgentLoopManager``'s per-worker
    lists of per-sample metrics (``AgentLoopMetrics``: generate_sequences, tool_calls, compute_score)."""
    keys = ("generate_sequences", "tool_calls", "compute_score")
    return [sum(float(m.get(key, 0.0)) for key in keys) for chunk in metrics for m in chunk]


#: non_tensor_batch keys that describe the sample itself rather than what its reward function found
_SAMPLE_KEYS = frozenset({"uid", "data_source", "min_global_steps", "max_global_steps", "raw_prompt", "raw_prompt_ids",
                          "index", "extra_info", "reward_model", "tools_kwargs", "interaction_kwargs",
                          "multi_modal_data", "multi_modal_inputs", "request_id", "agent_name", "finish_reason",
                          "stop_reason", "__num_turns__", DURATION_KEY})


def episodes_from_dataproto(batch: Any, fields: StepFields) -> list[dict[str, Any]]:
    """One episode per sample for rlwatch's reward-hack detectors (:func:`~.._tensors.episode_dicts`):
    response token ids, reward, environment, truncation, and the reward manager's extra info per
    sample (e.g. what a ``compute_score`` returned besides the score; a ``true_pass`` key there is
    read as an independent checker's verdict)."""
    import numpy as np

    tensors, extra = batch.batch, batch.non_tensor_batch
    mask = fields.mask.bool().cpu()
    B = int(mask.shape[0])
    scalar = (bool, int, float, str, np.bool_, np.integer, np.floating)
    info_keys = [k for k, v in extra.items() if k not in _SAMPLE_KEYS and isinstance(v, np.ndarray) and len(v) == B]
    infos = [{k: extra[k][i].item() if hasattr(extra[k][i], "item") else extra[k][i]
              for k in info_keys if isinstance(extra[k][i], scalar)} for i in range(B)]
    responses = tensors["responses"].cpu() if "responses" in tensors.keys() else None
    ids = [responses[i][mask[i]].tolist() for i in range(B)] if responses is not None else None
    return episode_dicts(fields, infos, ids)


def _truncated(extra: Mapping[str, Any], size: int, response_length: Any, prompt_length: Any, config: Any) -> Any:
    flags = _finish_flags(extra, size)
    if flags is not None:
        return flags
    return truncation_flags(response_length, prompt_length,
                            config_get(config, "actor_rollout_ref.rollout.response_length"),
                            config_get(config, "actor_rollout_ref.rollout.max_model_len"))


def _tq_fetch(tq: Any, keys: list[str], partition_id: str, fields: Iterable[str]) -> Any:
    """One ``kv_batch_get`` for all ``fields``; TransferQueue 0.1 leaves out fields it does not
    hold, other versions raise, in which case each field is fetched on its own and missing ones
    skipped."""
    fields = list(fields)
    try:
        return tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)
    except ValueError:
        from tensordict import TensorDict

        parts = {}
        for name in fields:
            try:
                got = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=[name])
            except ValueError:
                continue
            if name in got.keys():
                parts[name] = got[name]
        return TensorDict(parts, batch_size=[len(keys)])


def fields_from_transfer_queue(tq: Any, batch: Any, config: Any = None,
                               trainer_version: int | None = None) -> StepFields | None:
    """The step's fields for a v1 ``KVBatchMeta`` (keys, tags, partition_id), read from
    TransferQueue. Padding rows (tag ``is_padding``) are left out; None when nothing is left."""
    import torch

    rows = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
    if not rows:
        return None
    keys = [batch.keys[i] for i in rows]
    tags = [batch.tags[i] for i in rows]
    data = _tq_fetch(tq, keys, batch.partition_id, V1_FIELDS)
    names = set(data.keys())
    if "response_mask" not in names:
        return None
    extra = {name: data.pop(name).tolist() for name in ("uid", "data_source") if name in names}
    # Jagged per-sample tensors, unless every sample had the same length (then stacked).
    mask = data["response_mask"]
    stored_length = mask.offsets().diff() if mask.is_nested else mask.sum(-1)
    padded = data.to_padded_tensor() if any(data[n].is_nested for n in data.keys()) else data
    response_length = torch.tensor([t.get("response_len", int(n)) for t, n in zip(tags, stored_length.tolist())])
    prompt_length = torch.tensor([t["prompt_len"] for t in tags]) if all("prompt_len" in t for t in tags) else None
    fields = _token_fields(padded, names, config)
    if "rm_scores" in names:
        fields.rewards = padded["rm_scores"].sum(-1)
    if "entropy" in names:
        fields.entropy = padded["entropy"]
    versions = None
    if trainer_version is not None:
        versions = version_pairs([t.get("min_global_steps") for t in tags], [t.get("max_global_steps") for t in tags])
    return _sample_fields(fields, extra, len(keys), response_length, prompt_length, config, versions, trainer_version)
