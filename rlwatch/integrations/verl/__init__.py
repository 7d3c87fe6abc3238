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

``batch`` reads a step's ``DataProto`` or TransferQueue batch into its fields and episodes.

Which process exports (see ``_ray_actors.RayActorInstrumentor``)
    Only the trainer process (the TaskRunner actor, which holds the gathered batch and the
    ``Tracking`` logger) calls the wrapped functions, so exactly one process per job exports.

What is wrapped (``PATCHES``; every patch is ``_instrumentor.Instrumentor.wrap``)
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
      ``watch.log_scalars`` (``rlwatch_framework_metric{name}``), then the headline signals join
      ``data`` (``rlwatch/`` keys, see ``_trainer_logs``). verl asserts on unknown backend
      names, so rlwatch wraps the method instead of registering a backend.
    * ``verl.experimental.agent_loop.agent_loop.AgentLoopManager._performance_metrics(metrics,
      output)``: verl's per-sample agent-loop timers (generate_sequences + tool_calls +
      compute_score seconds) join the output batch as ``non_tensor_batch["rlwatch_episode_seconds"]``
      (the episode durations); the phases come from the step's ``timing_raw`` (``batch.VERL_PHASES``).
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
    The RLWATCH_* variables of ``rlwatch.core.config.env_watch_options`` (through ``runtime_env.env_vars``); the run
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
from typing import Any, Mapping

from .._instrumentor import Call, Hook, Patch, caller_self, context_value
from .._ray_actors import RayActorInstrumentor, config_get, framework_watch_options
from .._trainer_logs import mirror_call, without_headline
from .batch import (DURATION_KEY, episode_seconds, episodes_from_dataproto, fields_from_dataproto,  # noqa: F401
                    fields_from_transfer_queue, phases_from_timing, truncation_flags)

logger = logging.getLogger("rlwatch")

__all__ = ["VerlInstrumentor", "instrument", "uninstrument", "setup_hook", "truncation_flags",
           "watch_options_from_env", "INSTRUMENTOR"]

SUPPORTED = ">=0.9,<0.10"
METRIC_UTILS = "verl.trainer.ppo.metric_utils"
V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"
AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"

CHECKPOINT = Hook("verl_checkpoint", before="_checkpoint_dir", after="_record_checkpoint", watch=True)
#: module -> rows (class name, or None for a module function; attribute; hook)
PATCHES: dict[str, list[Patch]] = {
    METRIC_UTILS: [Patch(None, "compute_data_metrics",
                         Hook("verl_compute_data_metrics", after="_observe_dataproto", watch=True))],
    "verl.utils.tracking": [Patch("Tracking", "log", Hook("verl_tracking_log", before="_tracking_log", watch=True))],
    "verl.trainer.ppo.ray_trainer": [Patch("RayPPOTrainer", "_save_checkpoint", CHECKPOINT)],
    AGENT_LOOP: [Patch("AgentLoopManager", "_performance_metrics",
                       Hook("verl_episode_seconds", after="_keep_episode_seconds"))],
    V1_TRAINER: [Patch("PPOTrainer", "_compute_metrics",
                       Hook("verl_v1_compute_metrics", around="_v1_scope", after="_observe_v1", watch=True)),
                 Patch("PPOTrainer", "_save_checkpoint", CHECKPOINT)],
    # These only import compute_data_metrics by name; they are rebound if loaded before metric_utils
    # was patched (e.g. instrument() called after the trainer modules were imported).
    "verl.experimental.separation.ray_trainer": [],
    "verl.experimental.one_step_off_policy.ray_trainer": [],
}

# Set while the v1 _compute_metrics runs: the compute_data_metrics it calls sees a stripped batch
# that the v1 hook observes in full from TransferQueue.
_IN_V1_METRICS: contextvars.ContextVar[bool] = contextvars.ContextVar("rlwatch_verl_v1", default=False)


# --- configuration -------------------------------------------------------------------------------

def watch_options_from_env(environ: Mapping[str, str] | None = None, config: Any = None) -> dict[str, Any]:
    """``Watch`` keyword arguments from RLWATCH_* variables and the trainer's config (may be None),
    which names the run and the group size when the variables do not."""
    return framework_watch_options("verl", environ, run=config_get(config, "trainer.experiment_name"),
                                   group_size=config_get(config, "actor_rollout_ref.rollout.n"))


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
    """Wraps verl's metric, logging and checkpoint functions (``PATCHES``; see the package docstring)."""

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
        self._rebind(list(sys.modules.values()), restore=True)
        self._wrappers.clear()
        super()._uninstrument()

    def _patch_module(self, module: ModuleType) -> None:
        super()._patch_module(module)
        if module.__name__ != METRIC_UTILS:
            self._rebind([module])
            return
        for owner, attribute, _ in PATCHES[METRIC_UTILS]:
            wrapper = getattr(module, attribute, None)
            if owner is None and getattr(wrapper, "__rlwatch_original__", None) is not None:
                self._wrappers[attribute] = wrapper
        # Patched after other modules (verl's trainers, a user's recipe) bound the original with
        # ``from verl.trainer.ppo.metric_utils import compute_data_metrics``: rebind them all.
        self._rebind([other for other in list(sys.modules.values()) if other is not module])

    def _rebind(self, modules: list[Any], restore: bool = False) -> None:
        """Point names that ``modules`` imported from metric_utils (``from ... import f``) at the
        wrapper (``restore``: back at the original)."""
        for module in modules:
            namespace = vars(module) if isinstance(module, ModuleType) else {}
            for name, wrapper in list(self._wrappers.items()):
                original = wrapper.__rlwatch_original__
                if restore and namespace.get(name) is wrapper:
                    setattr(module, name, original)
                elif not restore and namespace.get(name) is original:
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

    # hooks (see PATCHES)

    def _observe_dataproto(self, call: Call) -> None:
        if _IN_V1_METRICS.get():                 # the v1 hook observes that batch from TransferQueue
            return
        trainer, batch = call.context, call.arg(0, "batch")
        fields = fields_from_dataproto(batch, getattr(trainer, "config", None), trainer_version(trainer))
        # v0 fit keeps timing_raw in a local of the calling frame, the separation trainers on self.
        timing = call.caller.f_locals.get("timing_raw") if call.caller is not None else None
        fields.phases = phases_from_timing(timing if timing is not None else getattr(trainer, "timing_raw", None))
        step = self.step_or_count(getattr(trainer, "global_steps", None))
        self.observe(step, fields, lambda fields: episodes_from_dataproto(batch, fields))

    def _v1_scope(self, call: Call) -> Any:
        return context_value(_IN_V1_METRICS, True)

    def _observe_v1(self, call: Call) -> None:
        """``PPOTrainer._compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch)``."""
        import transfer_queue as tq

        trainer, global_steps = call.args[0], int(call.arg(4, "global_steps"))
        fields = fields_from_transfer_queue(tq, call.arg(1, "batch"), trainer.config, global_steps - 1)
        fields.phases = phases_from_timing(call.arg(3, "timing_raw"))
        self.observe(global_steps, fields)

    def _keep_episode_seconds(self, call: Call) -> None:
        """``AgentLoopManager._performance_metrics(self, metrics, output)``: each sample's seconds join
        the output batch (``DURATION_KEY``), which follows the samples to ``compute_data_metrics``."""
        import numpy as np

        output = call.arg(2, "output")
        seconds = episode_seconds(call.arg(1, "metrics"))
        if len(seconds) == len(output):
            output.non_tensor_batch[DURATION_KEY] = np.array(seconds, dtype=np.float64)

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
#: ``rlwatch run``'s registration (:mod:`rlwatch.integrations.registry`).
AUTOLOAD = INSTRUMENTOR.autoload()
