"""The TRL integration's patches on one ``GRPOTrainer`` instance and its token-level path (once per
optimizer step, over every micro-batch of that step's loss)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ...core.fields import StepFields
from ...core.record import RecordBuilder
from ...core.rollout import PhaseClock
from .._instrumentor import Call, Hook, Instrumentor, Patch, guarded, missing
from .._tensors import pad_cat
from .generation import (PROBE_ROWS, VERSION_KEY, Generation, GenerationPath, GenerationSignals, audit_verdicts,
                         env_labels, eos_and_pad, episodes, hack_episode_inputs, judges_hacks, reported_versions,
                         truncation_flags)

SUPPORTED = ">=1.15,<1.17"

#: Rows patched on the trainer instance (owner None: the trainer itself; the class is untouched).
PATCHES = (
    Patch(None, "_calculate_rewards", Hook("trl_rewards", after="_after_rewards")),
    Patch(None, "_generate_and_score_completions",
          Hook("trl_generation", before="_forget_rewards", after="_after_generation")),
    Patch(None, "_compute_loss", Hook("trl_loss", around="_loss_scope", after="_after_loss")),
    Patch(None, "_get_per_token_logps_and_entropies", Hook("trl_logps", after="_keep_policy")),
    Patch(None, "training_step", Hook("trl_training_step", around="_training_scope")),
)
#: TRL's own timing points (``profiling_context(trainer, name)`` in ``trl.trainer.grpo_trainer``) -> phase.
TRL_PHASES = {"sync_weights": "sync", "vLLM.generate": "generation", "transformers.generate": "generation",
              "transformers.generate_batch": "generation"}
#: A process whose Watch exports nothing still takes part in the episode gather of a multi-process run.
GATHER_ONLY = (PATCHES[0], Patch(None, "_generate_and_score_completions",
                                 Hook("trl_gather", before="_forget_rewards", after="_gather_only")))


def _padded(micro: list["MicroBatch"], name: str, width: int) -> torch.Tensor | None:
    """The micro-batches' ``name`` tensors ([b, T] each) padded to ``width`` and concatenated; None
    unless every micro-batch has one."""
    parts = [getattr(m, name) for m in micro]
    return pad_cat(parts, width) if all(p is not None for p in parts) else None


@dataclass
class MicroBatch:
    """What one ``_compute_loss`` call trained on (device tensors, [b, T])."""

    mask: torch.Tensor
    trainer_logp: torch.Tensor
    sampler_logp: torch.Tensor | None
    entropy: torch.Tensor | None
    version: torch.Tensor                 # [b] int64
    trainer_version: int
    policy_logp: torch.Tensor | None = None  # the current policy's, where the batch is trained again


@dataclass
class _Capture:
    """Per-call scratch shared by the hooks of the nested patched calls (the thread that runs the
    trainer's loss and generation; never touched by rlwatch's own thread)."""

    rewards: dict[str, Any] | None = None
    in_loss: bool = False
    policy: tuple | None = None
    micro: list[MicroBatch] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)


class GRPOInstrumentor(GenerationPath, Instrumentor):
    """Patches one ``GRPOTrainer`` instance (``PATCHES``; see the package docstring for what and why)."""

    package = "trl"
    supported = SUPPORTED

    def __init__(self, trainer: Any, watch: Any) -> None:
        super().__init__()
        self.trainer = trainer
        self.watch = watch
        self.capture = _Capture()
        self._processes = 1
        self._serial = 0
        self._env_scalars: set[str] = set()
        self.listener = GenerationSignals()
        # Episode records of the generation batches (own label caps; built in order by Watch.defer's jobs).
        env_cap = getattr(getattr(watch, "watch_config", None), "env_cap", 64)
        self._builder = RecordBuilder(watch.errors, env_cap=env_cap)
        #: Where to keep a fixed sample of the first generation batch for ``rlwatch postmortem --probe``.
        self.probe_path: str | None = None
        self.probe_rows = PROBE_ROWS
        #: Seconds per phase since the last observed step, from TRL's timing points.
        self.phases = PhaseClock()

    # -- patches --

    def _missing(self) -> list[str]:
        return missing(self.trainer, PATCHES, type(self.trainer).__name__)

    def _instrument(self, **kwargs: Any) -> None:
        self._processes = int(getattr(getattr(self.trainer, "accelerator", None), "num_processes", 1) or 1)
        if not self.watch.active:
            if self._processes > 1:              # take part in the episode gather, export nothing
                self.apply(self.trainer, GATHER_ONLY)
            return
        listeners = getattr(self.watch, "listeners", None)
        if listeners is not None and self.listener not in listeners:
            listeners.add(self.listener, "integration")      # before drift, diagnosis and the alerts
        self.apply(self.trainer, PATCHES)
        self._time_trl_phases()

    def _time_trl_phases(self) -> None:
        """Wrap ``profiling_context`` where GRPOTrainer reads it: this trainer's generation and
        weight-sync blocks (``TRL_PHASES``) also add their seconds to :attr:`phases`."""
        import importlib

        module = importlib.import_module(type(self.trainer).__module__)
        module = module if hasattr(module, "profiling_context") else importlib.import_module("trl.trainer.grpo_trainer")
        original = getattr(module, "profiling_context", None)
        if original is None:
            return
        instrumentor = self

        def profiling_context(trainer: Any, name: str) -> Any:
            context = original(trainer, name)
            phase = TRL_PHASES.get(name)
            if trainer is not instrumentor.trainer or phase is None or not instrumentor._instrumented:
                return context
            return _Timed(context, instrumentor.phases, phase)
        profiling_context.__rlwatch_original__ = original
        self.replace(module, "profiling_context", profiling_context)

    def _uninstrument(self) -> None:
        self.capture.micro.clear()
        self.capture.generations.clear()
        self.capture.rewards = self.capture.policy = None
        listeners = getattr(self.watch, "listeners", None)
        if listeners is not None:
            listeners.remove(self.listener)

    # -- hooks (see PATCHES) --

    def _after_rewards(self, call: Call) -> None:
        """``_calculate_rewards(inputs, prompts, completions, completion_ids_list)``."""
        self._on_rewards(call.arg(0, "inputs"), call.arg(3, "completion_ids_list"), call.result,
                         call.arg(1, "prompts"), call.arg(2, "completions"))

    def _forget_rewards(self, call: Call) -> None:
        self.capture.rewards = None

    def _after_generation(self, call: Call) -> None:
        """``_generate_and_score_completions(inputs)``: gather (every rank, same order: never skipped),
        then keep the scored batch."""
        if self._processes > 1 and self.trainer.model.training:
            guarded(self.watch, "trl_gather")(self._gather_episodes)(call.result)
        self._on_generation(call.result)

    def _gather_only(self, call: Call) -> None:
        if self.trainer.model.training:
            self._gather_episodes(call.result)
        self.capture.rewards = None

    @contextlib.contextmanager
    def _loss_scope(self, call: Call) -> Iterator[None]:
        """``_compute_loss(model, inputs)``: while it runs, the first policy log-probs computed are kept."""
        capture = self.capture
        call.state = capture.in_loss = self.trainer.model.training and VERSION_KEY in call.arg(1, "inputs")
        capture.policy = None
        try:
            yield
        finally:
            capture.in_loss = False

    @contextlib.contextmanager
    def _training_scope(self, call: Call) -> Iterator[None]:
        """``training_step(model, inputs, num_items_in_batch)``: its seconds (TRL's own ``step_time``
        block) are the training phase."""
        with self.phases.phase("training"):
            yield

    def _after_loss(self, call: Call) -> None:
        try:
            if call.state:
                self._on_loss(call.arg(1, "inputs"))
        finally:
            self.capture.policy = None

    def _keep_policy(self, call: Call) -> None:
        if self.capture.in_loss and self.capture.policy is None:   # the policy forward of _compute_loss
            self.capture.policy = call.result

    # -- what the wrappers do --

    def _on_rewards(self, inputs: list[dict], completion_ids_list: list, rewards_per_func: torch.Tensor,
                    prompts: list | None = None, completions: list | None = None) -> None:
        """Keep the batch's rewards (every process's rows), this process's environment labels and
        truncation flags (host), and hand this process's episodes to the Watch's reward-hack detectors
        (which run off the training thread)."""
        trainer = self.trainer
        if not trainer.model.training:
            return
        B = len(completion_ids_list)
        start = trainer.accelerator.process_index * B
        # TRL reads these values on the host right after (.item(), .tolist()): no extra pipeline stall.
        per_func = rewards_per_func.detach().to("cpu", torch.float64)
        truncated = truncation_flags(completion_ids_list, eos_and_pad(trainer))
        env = env_labels(inputs)
        self.capture.rewards = {"per_func": per_func, "truncated": truncated, "env": env, "start": start,
                                "lengths": [len(ids) for ids in completion_ids_list],
                                "policy_version": reported_versions(inputs)}
        if prompts is not None and completions is not None and self._processes > 1:
            if judges_hacks(self.watch):     # every rank: gathered by _gather_hack_episodes, judged once
                self.capture.rewards["episode_inputs"] = hack_episode_inputs(
                    trainer, prompts, completions, completion_ids_list, per_func[start:start + B], truncated, env)
        elif prompts is not None and completions is not None and self.watch.hack_detection:
            # The checkers' verdicts are read now (the next reward call replaces them); the episodes
            # are built by a Watch.defer job (rlwatch's thread with background=True, else right here).
            step, verdicts = int(trainer.state.global_step), audit_verdicts(trainer, len(completions))
            local = per_func[start:start + B]
            self.watch.defer(lambda: self.watch.submit_episodes(step, episodes(trainer, [hack_episode_inputs(
                trainer, prompts, completions, completion_ids_list, local, truncated, env, verdicts)])))

    def _on_loss(self, inputs: dict) -> None:
        """Keep what this micro-batch trained on until the optimizer step ends."""
        policy = self.capture.policy
        if policy is None:
            return
        per_token_logps, entropies = policy[0], policy[1]
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        self.capture.micro.append(MicroBatch(
            mask=mask.detach(),
            trainer_logp=(old if old is not None else per_token_logps).detach(),
            sampler_logp=inputs.get("sampling_per_token_logps"),
            entropy=entropies.detach() if entropies is not None else None,
            version=inputs[VERSION_KEY], trainer_version=int(self.trainer.state.global_step),
            policy_logp=per_token_logps.detach() if old is not None else None))

    # -- one step --

    def step_fields(self, micro: list[MicroBatch]) -> StepFields:
        """The token-level fields of one optimizer step's micro-batches."""
        width = max(int(m.mask.shape[1]) for m in micro)
        fields = StepFields(mask=pad_cat([m.mask for m in micro], width),
                            trainer_logp=pad_cat([m.trainer_logp for m in micro], width),
                            seq_version=torch.cat([m.version.reshape(-1) for m in micro]),
                            trainer_version=micro[-1].trainer_version, **sampling_fields(self.trainer))
        for name, reason in (("sampler_logp", ("mismatch", "no_sampler_logprobs")),
                             ("entropy", ("entropy", "not_computed"))):
            setattr(fields, name, _padded(micro, name, width))
            if getattr(fields, name) is None:
                self.listener.unavailable[reason] = 1.0
        fields.updated_logp = _padded(micro, "policy_logp", width)     # the policy KL against the generating policy
        return fields

    def flush(self, step: int) -> None:
        """Observe the optimizer step that just ended: take the step's micro-batches and scored
        generation batches, and hand assembling and computing them to ``Watch.defer`` (rlwatch's
        thread with ``background=True``, else done right here on the training thread)."""
        micro, self.capture.micro = self.capture.micro, []
        generations, self.capture.generations = self.capture.generations, []
        phases = self.phases.take() if micro else None       # the step's phases, taken on the training thread
        if micro or generations:
            self.watch.defer(lambda: guarded(self.watch, "trl_observe")(self.observe_step)(
                step, micro, generations, phases))

    def observe_step(self, step: int, micro: list[MicroBatch], generations: list[Generation] | None = None,
                     phases: dict[str, float] | None = None) -> None:
        if generations:
            values = guarded(self.watch, "trl_generation_signals")(self.generation_values)(step, generations)
            if values:
                self.listener.submit(values)
            self.watch.log_scalars(step, self.reward_scalars(generations))
        if micro:
            fields = self.step_fields(micro)
            fields.phases = phases
            self.watch.observe_fields(step, fields)


class _Timed:
    """A TRL profiling context that also adds its seconds to a :class:`PhaseClock` phase."""

    def __init__(self, context: Any, clock: PhaseClock, phase: str) -> None:
        self.context, self.clock, self.phase = context, clock, phase
        self.start = 0.0

    def __enter__(self) -> Any:
        import time

        self.start = time.perf_counter()
        return self.context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        import time

        try:
            return self.context.__exit__(*exc)
        finally:
            self.clock.add(self.phase, time.perf_counter() - self.start)


def sampling_fields(trainer: Any) -> dict[str, Any]:
    """Sampling parameters of the trainer's generation (and vLLM's log-prob mode when it is TRL's)."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(trainer, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "rollout_func", None) is None:
        out["logprobs_mode"] = "processed_logprobs"      # what TRL's vLLM backend asks for
    return out

