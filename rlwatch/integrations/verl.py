"""rlwatch for verl 0.9.x (``pip install rlwatch[verl]``).

Every verl trainer loop runs inside a Ray actor (``TaskRunner``), never in the process that
launches the job, so a patch made in the launcher does not reach it. Ray's
``worker_process_setup_hook`` does: add one override to the verl launch line::

    python -m verl.trainer.main_ppo ... \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rlwatch.integrations.verl.setup_hook \\
        +ray_kwargs.ray_init.runtime_env.env_vars.RLWATCH_RUN=my-run \\
        +ray_kwargs.ray_init.runtime_env.env_vars.RLWATCH_SD_DIR=/shared/rlwatch-targets

(``main_ppo`` merges ``ray_kwargs.ray_init.runtime_env`` over its own defaults and passes it to
``ray.init``; see ``examples/verl_launch.sh``.) When the trainer runs in your own process instead,
call :func:`instrument` before building it.

Which process exports
    Ray runs the hook in every worker process (the TaskRunner, the FSDP/Megatron GPU workers, the
    rollout servers, the reward and agent-loop workers); what it does there, and when the Watch is
    created, is ``_base.RayActorInstrumentor``'s. Only the trainer process (the TaskRunner actor,
    which holds the gathered batch and the ``Tracking`` logger) calls the wrapped functions, so
    exactly one process per job exports.

What is wrapped (``PATCHES``; every patch is ``_base.Instrumentor.wrap``)
    * ``verl.trainer.ppo.metric_utils.compute_data_metrics(batch, use_critic)``: the gathered
      ``DataProto`` of a training step in the v0 ``RayPPOTrainer.fit``, the separation trainer and
      the fully-async and one-step-off recipes built on it. ``from ... import compute_data_metrics``
      binds the name at import time, so the module attribute is wrapped as soon as ``metric_utils``
      executes (before any trainer module binds it), and modules already holding the original are
      rebound.
    * ``verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_metrics`` (the default trainer since
      0.9.1): its batch is a ``KVBatchMeta`` of keys; the per-token fields are read from
      TransferQueue with ``tq.kv_batch_get`` before ``fit`` calls ``tq.kv_clear``.
    * ``verl.utils.tracking.Tracking.log(data, step)``: every scalar verl logs is mirrored with
      ``watch.log_scalars`` (``rlwatch_framework_metric{name}``). verl asserts on unknown backend
      names, so rlwatch wraps the method instead of registering a backend.
    * ``_save_checkpoint`` of ``RayPPOTrainer`` and the v1 ``PPOTrainer``: after it returns,
      ``default_local_dir/global_step_N`` is recorded with ``watch.record_checkpoint``. A trainer
      class that overrides it (``FullyAsyncTrainer``) is hooked on the instance the first time a
      wrapper meets it: ``FullyAsyncTrainer`` is a Ray actor class, which Ray pickles by value, so
      its class attributes are never patched.

Field mapping (DataProto / TransferQueue -> ``Watch.observe``)
    response_mask -> mask; rollout_log_probs -> sampler_logp; old_log_probs -> trainer_logp (left
    out in rollout-correction bypass mode, where verl copies the sampler's log-probs there);
    token_level_scores (v1: rm_scores) summed over tokens -> rewards; uid -> group_ids;
    data_source -> env; entropys/entropy -> entropy; (min_global_steps, max_global_steps) ->
    seq_version [B, 2] against trainer_version = the weights version the batch is trained from
    (``global_steps - 1``, as verl's ``training/off_policy/trajectory_staleness``; the fully-async
    trainer's ``current_param_version`` of the sync cycle); aborted samples (empty responses) ->
    failed="aborted"; truncation from the finish reason when the batch carries one, else from the
    true response length against the configured caps (see :func:`truncation_flags`). The step is
    the trainer's ``global_steps``.

Configuration
    The RLWATCH_* variables of ``_base.env_watch_options`` (through ``runtime_env.env_vars``); the run
    defaults to ``trainer.experiment_name``, the group size to ``rollout.n`` (RLWATCH_GROUP_SIZE=0:
    no group-size check).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import sys
from types import ModuleType
from typing import Any, Iterable, Mapping

from ._base import (Call, Hook, Patch, RayActorInstrumentor, caller_self, config_get, context_value,
                    framework_watch_options)
from ._trainer_logs import mirror_call, without_headline

logger = logging.getLogger("rlwatch")

__all__ = ["VerlInstrumentor", "instrument", "uninstrument", "setup_hook", "truncation_flags",
           "watch_options_from_env", "INSTRUMENTOR"]

SUPPORTED = ">=0.9,<0.10"
METRIC_UTILS = "verl.trainer.ppo.metric_utils"
V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"

CHECKPOINT = Hook("verl_checkpoint", before="_checkpoint_dir", after="_record_checkpoint", watch=True)
#: module -> rows (class name, or None for a module function; attribute; hook)
PATCHES: dict[str, list[Patch]] = {
    METRIC_UTILS: [Patch(None, "compute_data_metrics",
                         Hook("verl_compute_data_metrics", after="_observe_dataproto", watch=True))],
    "verl.utils.tracking": [Patch("Tracking", "log", Hook("verl_tracking_log", before="_tracking_log", watch=True))],
    "verl.trainer.ppo.ray_trainer": [Patch("RayPPOTrainer", "_save_checkpoint", CHECKPOINT)],
    V1_TRAINER: [Patch("PPOTrainer", "_compute_metrics",
                       Hook("verl_v1_compute_metrics", around="_v1_scope", after="_observe_v1", watch=True)),
                 Patch("PPOTrainer", "_save_checkpoint", CHECKPOINT)],
    # These only import compute_data_metrics by name; they are rebound if loaded before metric_utils
    # was patched (e.g. instrument() called after the trainer modules were imported).
    "verl.experimental.separation.ray_trainer": [],
    "verl.experimental.one_step_off_policy.ray_trainer": [],
}

#: Fields read from TransferQueue for the v1 trainer (absent ones are skipped).
V1_FIELDS = ("response_mask", "old_log_probs", "rollout_log_probs", "rm_scores", "entropy", "uid",
             "data_source")

#: Per-sample finish information, if a rollout puts it in the batch (verl 0.9.1 does not yet).
FINISH_KEYS = ("truncated", "finish_reason", "stop_reason")

# Set while the v1 _compute_metrics runs: the compute_data_metrics it calls sees a stripped batch
# that the v1 hook observes in full from TransferQueue.
_IN_V1_METRICS: contextvars.ContextVar[bool] = contextvars.ContextVar("rlwatch_verl_v1", default=False)


# --- configuration -------------------------------------------------------------------------------

def watch_options_from_env(environ: Mapping[str, str] | None = None, config: Any = None) -> dict[str, Any]:
    """``Watch`` keyword arguments from RLWATCH_* variables and the trainer's config (may be None),
    which names the run and the group size when the variables do not."""
    return framework_watch_options("verl", environ, run=config_get(config, "trainer.experiment_name"),
                                   group_size=config_get(config, "actor_rollout_ref.rollout.n"))


# --- reading verl's batch ------------------------------------------------------------------------

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


def _versions(first: Iterable[Any], last: Iterable[Any]) -> Any:
    """[B, 2] int64 (first, last) policy versions, or None when any sample lacks one."""
    import torch

    first, last = list(first), list(last)
    if not first or any(v is None for v in first) or any(v is None for v in last):
        return None
    return torch.tensor([[int(a), int(b)] for a, b in zip(first, last)], dtype=torch.int64)


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


def _bypass_mode(config: Any) -> bool:
    return bool(config_get(config, "algorithm.rollout_correction.bypass_mode", False))


def _trainer_logp(old: Any, rollout: Any, config: Any) -> Any:
    """old_log_probs unless it is a copy of the sampler's (rollout-correction bypass mode), where
    verl measures no trainer-side recompute and a zero mismatch would be a false reading."""
    import torch

    if old is None:
        return None
    if rollout is not None and (_bypass_mode(config) or old is rollout
                                or (old.shape == rollout.shape and torch.equal(old, rollout))):
        return None
    return old


def fields_from_dataproto(batch: Any, config: Any = None, trainer_version: int | None = None) -> dict[str, Any]:
    """``Watch.observe`` fields from a verl ``DataProto`` as ``compute_data_metrics`` receives it.

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
        fields["rewards"] = tensors[reward].sum(-1)
    entropy = next((key for key in ("entropys", "entropy") if key in present and tuple(tensors[key].shape) == (B, R)),
                   None)
    if entropy is not None:
        fields["entropy"] = tensors[entropy]
    versions = None
    if trainer_version is not None and "min_global_steps" in extra and "max_global_steps" in extra:
        versions = _versions(extra["min_global_steps"], extra["max_global_steps"])
    return _sample_fields(fields, extra, B, response_length, prompt_length, config, versions, trainer_version)


def _token_fields(tensors: Any, present: set[str], config: Any) -> dict[str, Any]:
    """mask, sampler_logp and trainer_logp ([B, R]) from a batch's tensors."""
    rollout = tensors["rollout_log_probs"] if "rollout_log_probs" in present else None
    old = tensors["old_log_probs"] if "old_log_probs" in present else None
    return dict(mask=tensors["response_mask"], sampler_logp=rollout, trainer_logp=_trainer_logp(old, rollout, config))


def _sample_fields(fields: dict[str, Any], extra: Mapping[str, Any], size: int, response_length: Any,
                   prompt_length: Any, config: Any, versions: Any, trainer_version: int | None) -> dict[str, Any]:
    """``fields`` completed with what both batch layouts give per sample (groups, environments,
    truncation, aborted samples, versions) and the sampling parameters; None values left out."""
    import torch

    fields["group_ids"] = _labels(extra.get("uid"))
    fields["env"] = _labels(extra.get("data_source"))
    fields["truncated"] = _truncated(extra, size, response_length, prompt_length, config)
    fields["failed"] = ["aborted" if n == 0 else None for n in torch.as_tensor(response_length).tolist()]
    if versions is not None and trainer_version is not None:
        fields.update(seq_version=versions, trainer_version=trainer_version)
    fields.update(_sampling(config))
    return {k: v for k, v in fields.items() if v is not None}


#: non_tensor_batch keys that describe the sample itself rather than what its reward function found
_SAMPLE_KEYS = frozenset({"uid", "data_source", "min_global_steps", "max_global_steps", "raw_prompt", "raw_prompt_ids",
                          "index", "extra_info", "reward_model", "tools_kwargs", "interaction_kwargs",
                          "multi_modal_data", "multi_modal_inputs", "request_id", "agent_name", "finish_reason",
                          "stop_reason", "__num_turns__"})


def episodes_from_dataproto(batch: Any, fields: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One episode per sample for rlwatch's reward-hack detectors: response token ids, reward,
    environment, truncation, and the reward manager's extra info per sample (e.g. what a
    ``compute_score`` returned besides the score; a ``true_pass`` key there is read as an independent
    checker's verdict)."""
    import numpy as np

    tensors, extra = batch.batch, batch.non_tensor_batch
    mask = fields["mask"].bool().cpu()
    responses = tensors["responses"].cpu() if "responses" in tensors.keys() else None
    rewards = fields["rewards"].double().cpu().tolist() if "rewards" in fields else [0.0] * mask.shape[0]
    env = fields.get("env") or ["default"] * mask.shape[0]
    truncated = fields["truncated"].tolist() if "truncated" in fields else [False] * mask.shape[0]
    info_keys = [k for k, v in extra.items() if k not in _SAMPLE_KEYS and isinstance(v, np.ndarray)
                 and len(v) == mask.shape[0]]
    out = []
    for i in range(mask.shape[0]):
        info = {}
        for key in info_keys:
            value = extra[key][i]
            if isinstance(value, (bool, int, float, str, np.bool_, np.integer, np.floating)):
                info[key] = value.item() if hasattr(value, "item") else value
        episode = {"env": str(env[i]), "reward": rewards[i], "truncated": bool(truncated[i]), "extra": info}
        if responses is not None:
            episode["response_ids"] = responses[i][mask[i]].tolist()
        out.append(episode)
    return out


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
                               trainer_version: int | None = None) -> dict[str, Any] | None:
    """``Watch.observe`` fields for a v1 ``KVBatchMeta`` (keys, tags, partition_id), read from
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
        fields["rewards"] = padded["rm_scores"].sum(-1)
    if "entropy" in names:
        fields["entropy"] = padded["entropy"]
    versions = None
    if trainer_version is not None:
        versions = _versions([t.get("min_global_steps") for t in tags], [t.get("max_global_steps") for t in tags])
    return _sample_fields(fields, extra, len(keys), response_length, prompt_length, config, versions, trainer_version)


# --- the trainer behind a call -------------------------------------------------------------------

def _is_trainer(obj: Any) -> bool:
    return hasattr(obj, "global_steps") and hasattr(obj, "config")


def trainer_version(trainer: Any) -> int | None:
    """The policy version a step trains from (what its old_log_probs were computed with).

    verl tags each trajectory with the ``global_steps`` of the weights the rollout server held
    (``update_weights(global_steps)`` after each step), so the batch of step N comes from version
    N - 1 when on-policy (verl's ``trajectory_staleness = (global_steps - 1) - max_global_steps``).
    The fully-async trainer versions weights by ``current_param_version``, bumped by
    ``_fit_update_local_step`` (before the metrics are collected) on the first local step of a new
    sync cycle."""
    if trainer is None:
        return None
    if hasattr(trainer, "current_param_version") and hasattr(trainer, "local_trigger_step"):
        bumped = getattr(trainer, "local_trigger_step", 1) == 1
        return int(trainer.current_param_version) - (1 if bumped else 0)
    steps = getattr(trainer, "global_steps", None)
    return int(steps) - 1 if isinstance(steps, int) else None


def checkpoint_dir(trainer: Any) -> tuple[int, str] | None:
    """(step, ``default_local_dir/global_step_N``) of the checkpoint ``_save_checkpoint`` writes."""
    root = config_get(trainer.config, "trainer.default_local_dir")
    if root is None:
        return None
    step = getattr(trainer, "current_param_version", None)   # fully-async names folders by version
    if not isinstance(step, int):
        step = trainer.global_steps
    return int(step), os.path.abspath(os.path.join(str(root), f"global_step_{step}"))


# --- the instrumentor ----------------------------------------------------------------------------

class VerlInstrumentor(RayActorInstrumentor):
    """Wraps verl's metric, logging and checkpoint functions (``PATCHES``; see the module docstring)."""

    package = "verl"
    supported = SUPPORTED
    patches = PATCHES
    label = "verl"

    def __init__(self) -> None:
        super().__init__()
        self._wrappers: dict[str, Any] = {}     # module function name -> its wrapper

    # life cycle

    def _uninstrument(self) -> None:
        # Modules imported while instrumented bound the wrapper themselves (not through patch()).
        for name, wrapper in self._wrappers.items():
            for module in list(sys.modules.values()):
                try:
                    if isinstance(module, ModuleType) and vars(module).get(name) is wrapper:
                        setattr(module, name, wrapper.__rlwatch_original__)
                except TypeError:
                    continue
        self._wrappers.clear()
        super()._uninstrument()

    def _patch_module(self, module: ModuleType) -> None:
        super()._patch_module(module)
        if module.__name__ != METRIC_UTILS:
            self._rebind(module)
            return
        for owner, attribute, _ in PATCHES[METRIC_UTILS]:
            wrapper = getattr(module, attribute, None)
            if owner is None and getattr(wrapper, "__rlwatch_original__", None) is not None:
                self._wrappers[attribute] = wrapper
        # Patched after other modules (verl's trainers, a user's recipe) bound the original with
        # ``from verl.trainer.ppo.metric_utils import compute_data_metrics``: rebind them all.
        for other in list(sys.modules.values()):
            if isinstance(other, ModuleType) and other is not module:
                self._rebind(other)

    def _rebind(self, module: ModuleType) -> None:
        """Point names a module imported from metric_utils (``from ... import f``) at the wrapper."""
        try:
            namespace = vars(module)
        except TypeError:
            return
        for name, wrapper in list(self._wrappers.items()):
            if namespace.get(name) is wrapper.__rlwatch_original__:
                self.replace(module, name, wrapper)

    # the Watch

    def _context(self, call: Call) -> Any:
        """The trainer behind a call: ``self`` of a trainer method, else found among the callers
        (``compute_data_metrics(batch, use_critic)`` is given neither the step nor the config)."""
        head = call.args[0] if call.args else None
        trainer = head if _is_trainer(head) else caller_self(call.caller, _is_trainer, 6)
        self._hook_trainer(trainer)
        return trainer

    def _watch_options(self, trainer: Any) -> dict[str, Any]:
        return watch_options_from_env(config=getattr(trainer, "config", None))

    def _watch_metadata(self, trainer: Any) -> dict[str, Any]:
        return {"trainer": type(trainer).__name__ if trainer is not None else None,
                "use_v1": config_get(getattr(trainer, "config", None), "trainer.use_v1")}

    def _observe(self, step: int, fields: dict[str, Any]) -> None:
        if fields:
            self.last_values = self.watch.observe(step, **fields)

    def _step(self, trainer: Any) -> int:
        steps = getattr(trainer, "global_steps", None)
        if isinstance(steps, int):
            return steps
        self._fallback_step += 1
        return self._fallback_step

    # hooks (see PATCHES)

    def _observe_dataproto(self, call: Call) -> None:
        if _IN_V1_METRICS.get():                 # the v1 hook observes that batch from TransferQueue
            return
        trainer, batch = call.context, call.arg(0, "batch")
        fields = fields_from_dataproto(batch, getattr(trainer, "config", None), trainer_version(trainer))
        if getattr(self.watch, "hack_detection", False):
            fields["episodes"] = episodes_from_dataproto(batch, fields)
        self._observe(self._step(trainer), fields)

    def _v1_scope(self, call: Call) -> Any:
        return context_value(_IN_V1_METRICS, True)

    def _observe_v1(self, call: Call) -> None:
        """``PPOTrainer._compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch)``."""
        import transfer_queue as tq

        trainer, global_steps = call.args[0], int(call.arg(4, "global_steps"))
        fields = fields_from_transfer_queue(tq, call.arg(1, "batch"), trainer.config, global_steps - 1)
        if fields:
            self._observe(global_steps, fields)

    def _tracking_log(self, call: Call) -> None:
        """``Tracking.log(self, data, step)``: mirror verl's scalars, then add the headline signals to
        ``data`` so that they reach verl's trackers (``rlwatch/`` prefix)."""
        data, step = call.arg(1, "data"), call.arg(2, "step")
        if isinstance(data, Mapping) and step is not None:
            self.watch.log_scalars(int(step), without_headline(data))
            mirror_call(call, 1, "data", self.watch, "verl_trainer_logs")

    def _checkpoint_dir(self, call: Call) -> None:
        call.state = checkpoint_dir(call.args[0])

    def _record_checkpoint(self, call: Call) -> None:
        if call.state is not None:
            self.watch.record_checkpoint(*call.state)

    def _hook_trainer(self, trainer: Any) -> None:
        """Hook ``_save_checkpoint`` on a trainer instance whose class overrides the patched one."""
        if trainer is None or "_save_checkpoint" in vars(trainer):
            return
        method = getattr(type(trainer), "_save_checkpoint", None)
        if method is None or getattr(method, "__rlwatch_original__", None) is not None:
            return
        bound = functools.partial(self.wrap(method, CHECKPOINT), trainer)
        bound.__rlwatch_original__ = method
        try:
            self.replace(trainer, "_save_checkpoint", bound)
        except Exception as exc:  # noqa: BLE001 - e.g. a class with __slots__
            logger.warning("rlwatch: cannot hook %s._save_checkpoint: %s", type(trainer).__name__, exc)


INSTRUMENTOR = VerlInstrumentor()


#: The module's entry points (see ``RayActorInstrumentor``): ``instrument(watch=None, **watch_kwargs)``,
#: ``uninstrument()`` and ``setup_hook()``, the Ray ``worker_process_setup_hook``.
instrument, uninstrument, setup_hook = INSTRUMENTOR.instrument, INSTRUMENTOR.uninstrument, INSTRUMENTOR.setup_hook
