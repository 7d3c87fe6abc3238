"""The OpenRLHF instrumentor: what is wrapped (``PATCHES``), the step context, the hooks; the package
docstring (:mod:`rlwatch.integrations.openrlhf`) says what each patch reads and how fields map."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ...core.fields import StepFields
from ...core.rollout import PhaseClock
from .._instrumentor import Call, Hook, Patch, context_value
from .._ray_actors import RayActorInstrumentor, config_get, framework_watch_options
from .._trainer_logs import mirror_call
from .experiences import episodes_from_experiences, fields_from_experiences
from .samples import (CLOCK_ACTOR, META, Filtered, LocalClock, RayClock, _DataSources, _Dispatch,  # noqa: F401
                      sample_meta)

logger = logging.getLogger("rlwatch")

SUPPORTED = ">=0.11,<0.12"
EXPERIENCE_MAKER = "openrlhf.trainer.ppo_utils.experience_maker"
PPO_TRAINER = "openrlhf.trainer.ppo_trainer"
SAMPLES_GENERATOR = "openrlhf.trainer.ppo_utils.samples_generator"
PROMPTS_DATASET = "openrlhf.datasets.prompts_dataset"

#: module -> rows (class name, method, hook)
PATCHES: dict[str, list[Patch]] = {
    EXPERIENCE_MAKER: [Patch("RemoteExperienceMaker", "make_experience_batch", Hook(
        "openrlhf_make_experience_batch", before="_read_stamps", after="_observe", watch=True))],
    PPO_TRAINER: [
        Patch("BasePPOTrainer", "train_step", Hook("openrlhf_train_step", before="_begin_step", around="_step_scope",
                                                   after="_end_step", watch=True)),
        Patch("BasePPOTrainer", "broadcast_to_vllm", Hook("openrlhf_broadcast", after="_bump")),
        Patch("BasePPOTrainer", "save_logs_and_checkpoints",
              Hook("openrlhf_save_logs", before="_mirror_save_logs", after="_logs_and_checkpoint", watch=True))],
    SAMPLES_GENERATOR: [
        Patch("SamplesGenerator", "generate_samples", Hook("openrlhf_generate", around="_generation_scope")),
        Patch("SamplesGenerator", "_generate_vllm",
              Hook("openrlhf_generate_vllm", around="_filter_scope", after="_count_filtered")),
        Patch("SamplesGenerator", "_dispatch_prompts_to_vllm", Hook("openrlhf_dispatch", before="_note_dispatch")),
        Patch("SamplesGenerator", "_process_response_into_experience", Hook("openrlhf_stamp", after="_stamp"))],
    PROMPTS_DATASET: [Patch("PromptDataset", "__init__", Hook("openrlhf_dataset", after="_remember_dataset"))],
}

#: Pending dispatch stamps kept per process at most (prompts whose responses never came back).
MAX_PENDING_PROMPTS = 100_000


# --- configuration -------------------------------------------------------------------------------

def is_correction_on(args: Any) -> bool:
    """Whether OpenRLHF requests vLLM log-probs (importance-sampling correction): 0.11.1+ has
    ``algo.advantage.is_correction_level`` (off/token/seq), 0.11.0 ``is_correction_enable``."""
    level = config_get(args, "algo.advantage.is_correction_level")
    if level is not None:
        return str(level) != "off"
    return bool(config_get(args, "algo.advantage.is_correction_enable", False))


def _mis_band(args: Any) -> tuple[float, float] | None:
    """OpenRLHF's IS threshold as rlwatch's masked-IS band, when it gates the ratio itself."""
    if not is_correction_on(args):
        return None
    if str(config_get(args, "algo.advantage.is_correction_gating", "ratio")) != "ratio":
        return None                     # a divergence bound (binary_kl / tv), not a ratio band
    threshold = config_get(args, "algo.advantage.is_correction_threshold")
    try:
        low, high = (float(x) for x in threshold)
    except (TypeError, ValueError):
        return None
    return (low, high) if 0 < low < 1 < high else None


def watch_options_from_env(environ: Mapping[str, str] | None = None, args: Any = None) -> dict[str, Any]:
    """``Watch`` keyword arguments from RLWATCH_* variables and OpenRLHF's arguments (may be None),
    which name the run, the group size and the masked-IS band when the variables do not."""
    opts = framework_watch_options("openrlhf", environ, run=config_get(args, "logger.wandb.run_name"),
                                   group_size=config_get(args, "rollout.n_samples_per_prompt"))
    band = _mis_band(args)
    if band is not None:
        opts["mis_band"] = band
    return opts


# --- the step context (set by train_step, read by make_experience_batch) --------------------------

@dataclass
class _StepContext:
    step: int
    trainer_version: int | None
    clock_id: str | None
    #: The step's (fields, episodes, extra scalars), observed when train_step returns, with its phases.
    pending: tuple | None = None


#: OpenRLHF's own per-phase timers in ``train_step``'s status -> rlwatch phases.
OPENRLHF_PHASES = {"timing/make_experience": "make_experience", "timing/ppo_train": "training",
                   "timing/broadcast": "sync"}


def phases_from_status(status: Any, vllm: bool) -> dict[str, float]:
    """The phases OpenRLHF timed in ``train_step`` (``status["timing/..."]``; ``sync`` only with ``vllm`` engines)."""
    phases: dict[str, float] = {}
    for key, phase in OPENRLHF_PHASES.items():
        value = status.get(key) if isinstance(status, Mapping) else None
        if isinstance(value, (int, float)) and (phase != "sync" or vllm):
            phases[phase] = float(value)
    return phases


_STEP: contextvars.ContextVar[_StepContext | None] = contextvars.ContextVar("rlwatch_openrlhf_step", default=None)


def checkpoint_dir(args: Any, global_step: int) -> str | None:
    """The directory OpenRLHF writes the step's checkpoint to: ``{ckpt.path}/global_step{N}_hf``
    with ``--ckpt.save_hf`` (loadable by transformers), else the DeepSpeed
    ``{ckpt.path}/_actor/global_step{N}``."""
    root = config_get(args, "ckpt.path")
    if root is None:
        return None
    tag = f"global_step{global_step}"
    if config_get(args, "ckpt.save_hf", False):
        return os.path.abspath(os.path.join(str(root), f"{tag}_hf"))
    if config_get(args, "ckpt.disable_ds", False):
        return None
    return os.path.abspath(os.path.join(str(root), "_actor", tag))


def step_phases(call: Call, generation: PhaseClock) -> dict[str, float]:
    """A returned ``train_step`` call's phases: OpenRLHF's timers in its status, and the generation
    seconds timed in this process (sync mode), else the calling ``fit``'s ``generation_time`` (async
    mode: the generator actor's, passed with the samples)."""
    result = call.result
    status = result[0] if isinstance(result, tuple) and result else None
    phases = phases_from_status(status, getattr(call.args[0], "vllm_engines", None) is not None)
    timed = generation.take()
    if timed:
        phases.update(timed)
    elif call.caller is not None and isinstance(call.caller.f_locals.get("generation_time"), (int, float)):
        phases["generation"] = float(call.caller.f_locals["generation_time"])
    return phases


def observe_pending(instrumentor: Any, context: Any, phases: dict[str, float] | None) -> None:
    """Observe the step held back (``context.pending``) with its phases and the samples filtered since the last."""
    pending, context.pending = getattr(context, "pending", None), None
    if pending is not None:
        pending[0].phases = phases or None
        for name, value in (instrumentor.filtered.take() or {}).items():
            setattr(pending[0], name, value)
        instrumentor.observe(context.step, pending[0], pending[1])
        if pending[2]:
            instrumentor.watch.log_scalars(context.step, pending[2])


# --- the instrumentor ----------------------------------------------------------------------------

class OpenRLHFInstrumentor(RayActorInstrumentor):
    """Wraps OpenRLHF's trainer, experience maker and sample generator (``PATCHES``; see the package
    docstring)."""

    package = "openrlhf"
    supported = SUPPORTED
    patches = PATCHES
    label = "OpenRLHF"

    def __init__(self) -> None:
        super().__init__()
        self.last_fields: StepFields | None = None          # the latest step's, without its episodes
        self._local_clock: LocalClock | None = None
        self._ray_clock: RayClock | None = None
        self._clock_lock = threading.Lock()
        self._pending: dict[str, collections.deque] = {}
        self._pending_lock = threading.Lock()
        self.datasources = _DataSources()
        self.phases = PhaseClock()           # generate_samples' seconds, until the step that trains on them
        self.filtered = Filtered()           # samples dynamic filtering dropped, until the next step

    def _uninstrument(self) -> None:
        super()._uninstrument()
        with self._pending_lock:
            self._pending.clear()
        with self._clock_lock:                       # a new instrumentation counts from 0 again
            self._local_clock = None
            self._ray_clock = None

    # the Watch

    def _context(self, call: Call) -> Any:
        """OpenRLHF's arguments, from the trainer or experience maker whose method was called."""
        return getattr(call.args[0], "args", None) if call.args else None

    def _watch_options(self, args: Any) -> dict[str, Any]:
        return watch_options_from_env(args=args)

    def _watch_metadata(self, args: Any) -> dict[str, Any]:
        return {"async": bool(config_get(args, "train.async_enable", False)),
                "partial_rollout": bool(config_get(args, "train.partial_rollout_enable", False)),
                "is_correction": is_correction_on(args),
                "advantage_estimator": config_get(args, "algo.advantage.estimator")}

    # the clock

    def clock(self, args: Any) -> LocalClock | RayClock | None:
        """The version clock for this run: local in sync mode; in async mode a Ray actor shared by
        the trainer and the generator (None when Ray is unusable: versions are then not stamped)."""
        with self._clock_lock:
            if not config_get(args, "train.async_enable", False):
                self._local_clock = self._local_clock or LocalClock()
                return self._local_clock
            if self._ray_clock is None:
                try:
                    self._ray_clock = RayClock()
                except Exception as exc:  # noqa: BLE001
                    logger.warning("rlwatch: no shared policy-version counter (async OpenRLHF): %s", exc)
                    return None
            return self._ray_clock

    def _step_context(self, args: Any, step: int) -> _StepContext:
        clock = self.clock(args)
        return _StepContext(step=step, trainer_version=clock.read() if clock is not None else None,
                            clock_id=clock.id if clock is not None else None)

    # hooks (see PATCHES)

    def _begin_step(self, call: Call) -> None:
        """``train_step(self, rollout_samples, global_step)``: step ``global_step + 1``, version before its update."""
        call.state = self._step_context(call.args[0].args, int(call.arg(2, "global_step")) + 1)

    @contextlib.contextmanager
    def _step_scope(self, call: Call) -> Any:
        with context_value(_STEP, call.state):
            try:
                yield
            except BaseException:
                observe_pending(self, call.state, None)      # train_step failed: the step is still observed
                raise

    def _generation_scope(self, call: Call) -> Any:
        """``generate_samples``: what ``fit`` times as ``timing/generation``, the next step's generation."""
        return self.phases.phase("generation")

    def _end_step(self, call: Call) -> None:
        """``train_step`` returned ``(status, global_step)``: observe the step with its phases."""
        observe_pending(self, call.state, step_phases(call, self.phases))

    _filter_scope = property(lambda self: self.filtered.scope)      # _generate_vllm: the samples it keeps
    _count_filtered = property(lambda self: self.filtered.count)

    def _read_stamps(self, call: Call) -> None:
        samples = call.arg(1, "rollout_samples")
        call.state = [sample_meta(s) for s in samples] if isinstance(samples, list) else []

    def _observe(self, call: Call) -> None:
        """``make_experience_batch(self, rollout_samples)``: one ``observe`` of its Experiences."""
        args = call.context
        # Outside train_step (a user's own loop): this process's own step count, observed now; inside,
        # when train_step returns (with the phases OpenRLHF timed).
        inside = _STEP.get()
        context = inside or self._step_context(args, self.step_or_count(None))
        experiences = list(call.result)
        fields, extra = fields_from_experiences(experiences, call.state, args, context.trainer_version,
                                                context.clock_id)
        if fields is None:
            return
        self.last_fields = fields
        stamps = call.state
        context.pending = (fields, lambda fields: episodes_from_experiences(experiences, fields, stamps), extra)
        if inside is None:
            observe_pending(self, context, None)

    def _bump(self, call: Call) -> None:
        clock = self.clock(getattr(call.args[0], "args", None))
        if clock is not None:
            clock.bump()

    def _mirror_save_logs(self, call: Call) -> None:
        """``save_logs_and_checkpoints(self, global_step, logs_dict, ...)``: the headline signals join its logs."""
        mirror_call(call, 2, "logs_dict", self.watch, "openrlhf_trainer_logs")

    def _logs_and_checkpoint(self, call: Call) -> None:
        trainer, step, logs_dict = call.args[0], int(call.arg(1, "global_step")), call.state
        if isinstance(logs_dict, Mapping) and logs_dict:
            self.watch.log_scalars(step, logs_dict)
        save_steps = config_get(trainer.args, "ckpt.save_steps")
        try:
            due = save_steps is not None and float(save_steps) > 0 and step % save_steps == 0
        except (TypeError, ValueError, ZeroDivisionError):
            due = False
        path = checkpoint_dir(trainer.args, step) if due else None
        if path is not None:
            self.watch.record_checkpoint(step, path)

    def _note_dispatch(self, call: Call) -> None:
        """``_dispatch_prompts_to_vllm(self, prompts, labels, **generate_kwargs)``: remember the policy
        version and sampling parameters each prompt was sent with."""
        generator, prompts, generate_kwargs = call.args[0], call.arg(1, "prompts"), call.kwargs
        clock = self.clock(generator.args)
        if clock is None:
            return
        version = clock.read()
        n = int(generate_kwargs.get("n_samples_per_prompt",
                                    config_get(generator.args, "rollout.n_samples_per_prompt", 1)))
        # The sampling parameters OpenRLHF builds from the same kwargs (SamplingParams defaults).
        sampling = {"temperature": float(generate_kwargs.get("temperature", 1.0)),
                    "top_p": float(generate_kwargs.get("top_p", 1.0)),
                    "top_k": int(generate_kwargs.get("top_k", -1))}
        with self._pending_lock:
            if len(self._pending) > MAX_PENDING_PROMPTS:
                self._pending.clear()
            for prompt in prompts:
                if isinstance(prompt, str):
                    self._pending.setdefault(prompt, collections.deque()).append(_Dispatch(version, n, sampling))

    def _take_dispatch(self, prompt: Any) -> _Dispatch | None:
        with self._pending_lock:
            queue = self._pending.get(prompt) if isinstance(prompt, str) else None
            if not queue:
                return None
            head = queue[0]
            head.remaining -= 1
            if head.remaining <= 0:
                queue.popleft()
                if not queue:
                    del self._pending[prompt]
            return head

    def _stamp(self, call: Call) -> None:
        """``_process_response_into_experience(self, response)``: stamp the Experience it returns."""
        generator, response, experience = call.args[0], call.arg(1, "response"), call.result
        clock = self.clock(generator.args)
        prompt = response.get("prompt")
        dispatch = self._take_dispatch(prompt)
        meta: dict[str, Any] = {"clock": clock.id if clock is not None else None}
        if clock is not None:
            end = clock.read()
            meta["version"] = (dispatch.version if dispatch is not None else end, end)
        if dispatch is not None:
            meta["sampling"] = dispatch.sampling
        if "truncated" in response:
            meta["truncated"], meta["truncation"] = bool(response["truncated"]), "finish_reason"
        else:
            # 0.11.0's multi-turn executor reports no finish reason; it stops when the context is
            # full, which OpenRLHF records as response_clip_ratio (total_length >= max_len).
            clipped = experience.info.get("response_clip_ratio") if isinstance(experience.info, Mapping) else None
            if clipped is not None:
                meta["truncated"], meta["truncation"] = bool(clipped.reshape(-1)[0]), "context"
        source = self.datasources.lookup(prompt)
        if source is not None:
            meta["env"] = source
        extra = response.get("extra_logs")
        if isinstance(extra, Mapping) and extra:
            meta["extra_logs"] = tuple(str(k) for k in extra)
        vars(experience)[META] = meta
        self.filtered.saw(experience)

    def _remember_dataset(self, call: Call) -> None:
        self.datasources.add(call.args[0])

    def _wrap_make_experience_batch(self, original: Callable) -> Callable:
        """The wrapper of ``make_experience_batch`` around any function (tests)."""
        return self.wrap(original, PATCHES[EXPERIENCE_MAKER][0].hook)


INSTRUMENTOR = OpenRLHFInstrumentor()


#: The module's entry points (see ``RayActorInstrumentor``): ``instrument(watch=None, **watch_kwargs)``,
#: ``uninstrument()`` and ``setup_hook()``, the Ray ``worker_process_setup_hook``; AUTOLOAD for ``rlwatch run``.
instrument, uninstrument, setup_hook = INSTRUMENTOR.instrument, INSTRUMENTOR.uninstrument, INSTRUMENTOR.setup_hook
AUTOLOAD = INSTRUMENTOR.autoload()
