"""TRL integration: per-token health signals from ``GRPOTrainer`` (TRL 1.15.x and 1.16.x; 1.16.0 is
the version the tests run, 1.15.0's hooked methods were checked to be identical in source).

One line::

    w = rlwatch.integrations.trl.watch(trainer)      # or callbacks=[RLWatchCallback(watch)]
    trainer.train()

What is read, and where (``PATCHES``: attributes of the one trainer instance, the class is untouched;
every patch is ``_base.Instrumentor.wrap``, which calls the original and returns its result):

- ``_calculate_rewards(inputs, prompts, completions, completion_ids_list)``: the rewards per reward
  function of the whole generation batch (TRL gathers them over processes), the dataset rows (for
  the ``environment`` / ``env`` / ``data_source`` column) and the unpadded completion ids
  (truncation: last token is not EOS or pad, TRL's own ``completions/clipped_ratio`` rule).
- ``_generate_and_score_completions(inputs)``: the generation batch once it is scored. Its
  episode-level data (rewards, truncation, completion lengths as TRL counts them, environments) is
  gathered over processes as TRL gathers its own (``accelerator.gather``; ``gather_object`` for the
  labels). Each sample is stamped with the policy version, ``state.global_step`` at generation
  time, as a ``[B]`` tensor (``rlwatch_version``); it follows TRL's ``shuffle_sequence_dict`` /
  ``split_tensor_dict`` and TRL's loss never reads it.
- ``_compute_loss(model, inputs)`` and the ``_get_per_token_logps_and_entropies`` call it makes for
  the policy: per micro-batch, the loss mask (``completion_mask * tool_mask``), the sampler
  log-probs ``sampling_per_token_logps`` (vLLM or a ``rollout_func``; absent with transformers
  generation), the trainer's log-probs of the same tokens, and the per-token entropy TRL computes
  for its own ``entropy`` metric (no extra forward pass).

**Two granularities** (README, "TRL: where each signal comes from"). Token-level signals are
computed once per optimizer step over every micro-batch of that step's loss (:meth:`step_fields`);
episode-level ones once per generation batch, on the whole gathered batch (:class:`Generation`),
exported with the step that scored it and repeated on steps that score none
(:class:`GenerationSignals`).

**Trainer log-probs.** ``trainer_logp`` is exactly the π_old that TRL's loss uses:
``old_per_token_logps`` when TRL computed it at generation time; otherwise (TRL skips it when every
use of a generation falls inside one optimizer step, so no update happened in between) the
current policy's per-token log-probs, detached, which TRL itself substitutes for π_old and which
are then equal to it.

**Steps and versions.** ``step`` is ``state.global_step`` after the update (the step TRL logs and
names checkpoints by); ``trainer_version`` is ``state.global_step`` when the loss was computed, so
``lag = trainer_version - version`` counts the optimizer updates between generation and use. With
``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps`` the lag is
positive for reused or later-used samples.

**Unavailable signals** (no sampler log-probs with transformers generation, no environment
column, a batch no reward function could score) are counted in ``rlwatch_signal_unavailable_total``.

Also: the reward per sample (weighted sum as TRL logs it; samples that every reward function
scored ``None`` are ``failed="unscorable"`` and kept out of the reward statistics), per-function
reward means of each batch as framework scalars (``rlwatch/rewards/<func>/mean`` and, with an
environment column, ``rlwatch/rewards/<func>/<env>/mean``), the episodes for the reward-hack
detectors once per batch (every process's completions, gathered with ``gather_object`` as TRL
gathers its logged completions), sampling parameters, TRL's logged scalars (``on_log``) and
checkpoints (``on_save``).

Guard actions :func:`stop_on_critical` and :func:`save_on_critical` turn a critical alert into
``control.should_training_stop`` / ``control.should_save`` at the trainer's next callback.

Multi-process runs: a rank captures token-level data only if its Watch exports (rank 0 by default,
every rank with ``Watch(all_ranks=True)``) and observes its own micro-batches; every rank takes part
in the gathers of episode-level data per generation batch (and of the hack detectors' episodes,
unless ``hack_detectors=False``, an option that must then be the same on every rank). With guard
actions the stop/save request is all-reduced across ranks at each step end so that every rank
stops together. (``tests/test_trl_multiprocess.py`` trains in two processes with gloo on CPU.)

Cost: one host transfer per step (``Watch.observe``) and one per generation batch (its episode
signals), besides a copy of the rewards to the host where TRL reads them anyway.

``trl.experimental.async_grpo.AsyncGRPOTrainer`` is a different trainer (packed tree-attention
batches from a vLLM server); only its logs, checkpoints and guards are handled here.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..postmortem.probe import ROLLOUTS_FILE
from . import _base, _trainer_logs
from ._base import Call, Hook, Instrumentor, Patch, caller_self, guarded

try:  # TRL pulls in transformers; the callback base class is all this module needs from it.
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - rlwatch itself does not depend on transformers
    TrainerCallback = object  # type: ignore[assignment,misc]

logger = logging.getLogger("rlwatch")

SUPPORTED = ">=1.15,<1.17"
#: Dataset columns read as the environment label, first match wins.
ENV_COLUMNS = ("environment", "env", "data_source")
#: Key added to TRL's generation batch (one entry per sample, so it survives shuffling/splitting).
VERSION_KEY = "rlwatch_version"
UNSCORABLE = "unscorable"
#: Per-environment per-function reward scalars kept per run (the Watch keeps 256 scalar names).
MAX_ENV_SCALARS = 64
#: Sequences of the first generation batch kept for ``rlwatch postmortem --probe``.
PROBE_ROWS = 32

#: Rows patched on the trainer instance (owner None: the trainer itself; the class is untouched).
PATCHES = (
    Patch(None, "_calculate_rewards", Hook("trl_rewards", after="_after_rewards")),
    Patch(None, "_generate_and_score_completions",
          Hook("trl_generation", before="_forget_rewards", after="_after_generation")),
    Patch(None, "_compute_loss", Hook("trl_loss", around="_loss_scope", after="_after_loss")),
    Patch(None, "_get_per_token_logps_and_entropies", Hook("trl_logps", after="_keep_policy")),
)
#: A process whose Watch exports nothing still takes part in the episode gather of a multi-process run.
GATHER_ONLY = (PATCHES[0], Patch(None, "_generate_and_score_completions",
                                 Hook("trl_gather", before="_forget_rewards", after="_gather_only")))

#: Families computed once per generation batch (whole groups); gauges among them are repeated on
#: steps that score no batch, counters count each batch once.
GENERATION_FAMILIES = frozenset({
    "reward_mean", "reward_std", "groups", "groups_total", "zero_variance_groups_ratio",
    "zero_variance_groups_total", "zero_gradient_episodes_ratio", "truncated_ratio", "response_length_mean",
    "response_length_p99", "response_length_max", "env_episodes", "env_reward_mean", "env_truncated_ratio",
    "env_zero_variance_groups_ratio", "env_reward_length_corr", "env_failure_ratio", "episodes_total",
    "episodes_truncated_total", "episodes_failed_total", "generation", "generation_policy_version",
})
#: What the token-level step record says about its own episodes; replaced by the generation's values.
STEP_EPISODE_FAMILIES = frozenset({"response_length_mean", "response_length_p99", "response_length_max",
                                   "env_episodes", "episodes_total"})


# --- host-side records --------------------------------------------------------------------------

@dataclass
class Generation:
    """Episode-level data of one whole generation batch, gathered over processes (N rows, host)."""

    serial: int                           # 1-based count of this run's generation batches
    version: int                          # state.global_step when it was generated
    rewards: torch.Tensor                 # [N] float64, weighted sum over reward functions (NaN: unscorable)
    per_func: torch.Tensor                # [N, F] float64, NaN where a function returned None
    func_names: list[str]
    truncated: torch.Tensor               # [N] bool
    lengths: torch.Tensor                 # [N] int64, completion tokens as TRL counts them
    group_ids: torch.Tensor               # [N] int64, unique within the run
    env: list[str] | None = None          # [N] labels, or None without an environment column
    failed: list[str | None] = field(default_factory=list)   # [N] "unscorable" or None

    def __post_init__(self) -> None:
        if not self.failed:
            self.failed = [UNSCORABLE if bad else None for bad in torch.isnan(self.rewards).tolist()]


@dataclass
class MicroBatch:
    """What one ``_compute_loss`` call trained on (device tensors, [b, T])."""

    mask: torch.Tensor
    trainer_logp: torch.Tensor
    sampler_logp: torch.Tensor | None
    entropy: torch.Tensor | None
    version: torch.Tensor                 # [b] int64
    trainer_version: int


@dataclass
class _Capture:
    """Per-call scratch shared by the hooks of the nested patched calls (the thread that runs the
    trainer's loss and generation; never touched by rlwatch's own thread)."""

    rewards: dict[str, Any] | None = None
    in_loss: bool = False
    policy: tuple | None = None
    micro: list[MicroBatch] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)


class GenerationSignals:
    """A Watch step listener (placed first) that exports the episode-level values of the generation
    batches with the optimizer step that scored them, repeats the latest batch's gauges on steps that
    score none, and adds the step's ``signal_unavailable_total`` increments.

    The token-level step record carries no episode fields; what it computes about its own episodes
    (``STEP_EPISODE_FAMILIES``: lengths of the trained rows, ``env="default"`` counts) is dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self._gauges: dict = {}
        self.unavailable: dict[tuple[str, str], float] = {}

    def submit(self, values: dict) -> None:
        with self._lock:
            self._pending.append(values)

    def on_step(self, step: int, values: dict) -> dict:
        from ..metrics import BY_NAME

        for name in STEP_EPISODE_FAMILIES:
            values.pop(name, None)
        with self._lock:
            pending, self._pending = self._pending, []
        extra: dict = {}
        for batch in pending:                  # normally one: a step's batches are computed together
            for name, family in batch.items():
                spec = BY_NAME.get(name)
                if spec is not None and spec.kind == "counter":
                    merged = extra.setdefault(name, {})
                    for labels, v in family.items():
                        merged[labels] = (merged.get(labels) or 0.0) + (v or 0.0)
                else:
                    extra[name] = dict(family)
        if pending:
            self._gauges = {name: family for name, family in extra.items()
                            if BY_NAME.get(name) is None or BY_NAME[name].kind != "counter"}
        else:
            extra.update({name: dict(family) for name, family in self._gauges.items()})
        if self.unavailable:
            extra["signal_unavailable_total"] = dict(self.unavailable)
            self.unavailable = {}
        return extra

    def close(self) -> None:
        with self._lock:
            self._pending.clear()


# --- the instrumentor ------------------------------------------------------------------------------

class GRPOInstrumentor(Instrumentor):
    """Patches one ``GRPOTrainer`` instance (``PATCHES``; see the module docstring for what and why)."""

    package = "trl"
    supported = SUPPORTED

    def __init__(self, trainer: Any, watch: Any) -> None:
        from ..record import RecordBuilder

        super().__init__()
        self.trainer = trainer
        self.watch = watch
        self.capture = _Capture()
        self._processes = 1
        self._serial = 0
        self._env_scalars: set[str] = set()
        self.listener = GenerationSignals()
        # Episode records of the generation batches (own label caps; built in order by Watch.defer's jobs).
        env_cap = getattr(getattr(getattr(watch, "_builder", None), "envs", None), "cap", 64)
        self._builder = RecordBuilder(watch.errors, env_cap=env_cap)
        #: Where to keep a fixed sample of the first generation batch for ``rlwatch postmortem --probe``.
        self.probe_path: str | None = None
        self.probe_rows = PROBE_ROWS

    # -- patches --

    def _instrument(self, **kwargs: Any) -> None:
        self._processes = int(getattr(getattr(self.trainer, "accelerator", None), "num_processes", 1) or 1)
        if not self.watch.active:
            if self._processes > 1:              # take part in the episode gather, export nothing
                self.apply(self.trainer, GATHER_ONLY)
            return
        listeners = getattr(self.watch, "listeners", None)
        if isinstance(listeners, list) and self.listener not in listeners:
            listeners.insert(0, self.listener)       # before drift, diagnosis and the alert evaluator
        self.apply(self.trainer, PATCHES)

    def _uninstrument(self) -> None:
        self.capture.micro.clear()
        self.capture.generations.clear()
        self.capture.rewards = self.capture.policy = None
        listeners = getattr(self.watch, "listeners", None)
        if isinstance(listeners, list) and self.listener in listeners:
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
                                "lengths": [len(ids) for ids in completion_ids_list]}
        if prompts is not None and completions is not None and self._processes > 1:
            if judges_hacks(self.watch):     # every rank: gathered by _gather_hack_episodes, judged once
                self.capture.rewards["episode_inputs"] = hack_episode_inputs(
                    trainer, prompts, completions, completion_ids_list, per_func[start:start + B], truncated, env)
        elif prompts is not None and completions is not None and self.watch.hack_detection:
            # The checkers' verdicts are read now (the next reward call replaces them); the episodes
            # are built by a Watch.defer job (rlwatch's thread with background=True, else right here).
            step, verdicts = int(trainer.state.global_step), audit_verdicts(trainer, len(completions))
            local = per_func[start:start + B]
            self.watch.defer(lambda: self.watch.submit_episodes(step, episodes(
                trainer, prompts, completions, completion_ids_list, local, truncated, env, verdicts)))

    def _local_episode_table(self, output: dict, captured: dict | None) -> tuple[torch.Tensor, list[str] | None]:
        """[B, 2] int64 (truncated, completion length as TRL counts it) of this process's batch, and its
        environment labels. Never raises: a gather that one rank skipped would hang every rank."""
        B = int(output["completion_ids"].shape[0])
        try:
            lengths = torch.tensor(captured["lengths"], dtype=torch.int64)
            tool_mask = output.get("tool_mask")
            if tool_mask is not None:         # TRL counts only the model's own tokens (tool_mask = 1)
                width = tool_mask.shape[1]
                inside = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
                lengths = (tool_mask.detach().cpu().to(torch.int64) * inside).sum(1)
            table = torch.stack([captured["truncated"].to(torch.int64), lengths], 1)
            assert table.shape == (B, 2)
            return table, captured["env"]
        except Exception:  # noqa: BLE001 - reported by the caller (missing capture), shapes kept
            return torch.full((B, 2), -1, dtype=torch.int64), (
                ["?"] * B if captured is not None and captured.get("env") is not None else None)

    def _gather_episodes(self, output: dict) -> None:
        """All processes: gather the batch's truncation flags, lengths and labels as TRL gathers its own."""
        from accelerate.utils import gather_object

        accelerator = self.trainer.accelerator
        table, env = self._local_episode_table(output, self.capture.rewards)
        gathered = accelerator.gather(table.to(accelerator.device)).cpu()
        if env_labels_present(self.trainer):
            labels = gather_object(list(env) if env is not None else ["default"] * int(table.shape[0]))
        else:
            labels = None
        if self.capture.rewards is not None:
            self.capture.rewards["gathered"] = (gathered, labels)
        self._gather_hack_episodes()

    def _gather_hack_episodes(self) -> None:
        """All processes (when the Watches judge reward hacks: an option, the same on every rank): gather
        the generation batch's episodes for the hack detectors as TRL gathers its logged completions
        (``gather_object``, process order), so that an exporting process judges every process's
        episodes once and per-environment hack rates count them all. Nothing raises before the gather."""
        from accelerate.utils import gather_object

        if not judges_hacks(self.watch):
            return
        captured = self.capture.rewards
        parts = gather_object([captured.pop("episode_inputs", None) if captured is not None else None])
        if not self.watch.hack_detection:
            return
        whole = [p for p in parts if p is not None]
        if len(whole) < len(parts):
            self.watch.errors.report("integration", "trl_hack_gather", f"{len(parts) - len(whole)} of {len(parts)} "
                                     "processes had no episodes for the hack detectors", raise_in_strict=False)
        if not whole:
            return
        trainer, step = self.trainer, int(self.trainer.state.global_step)
        self.watch.defer(lambda: self.watch.submit_episodes(step, episodes(trainer, *merge_episode_inputs(whole))))

    def _on_generation(self, output: dict) -> None:
        """Stamp the batch with the policy version; keep its episode-level data for the step's flush."""
        trainer, captured = self.trainer, self.capture.rewards
        self.capture.rewards = None
        if not trainer.model.training or captured is None:
            return
        completion_ids = output["completion_ids"]
        B = int(completion_ids.shape[0])
        version = int(trainer.state.global_step)
        output[VERSION_KEY] = torch.full((B,), version, dtype=torch.int64, device=completion_ids.device)
        per_func = captured["per_func"]
        if "gathered" in captured:
            table, env = captured["gathered"]
        else:
            table, env = self._local_episode_table(output, captured)
        N = int(per_func.shape[0])
        if bool((table < 0).any()) or table.shape[0] != N or (env is not None and len(env) != N):
            raise RuntimeError(f"the episode data of a generation batch could not be captured whole ({N} "
                               f"rewards, {table.shape[0]} rows of truncation and lengths)")
        weights = trainer.reward_weights.detach().to("cpu", torch.float64)
        rewards = (per_func * weights).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = float("nan")
        G = max(int(trainer.num_generations), 1)
        self._serial += 1
        self.capture.generations.append(Generation(
            serial=self._serial, version=version, rewards=rewards, per_func=per_func,
            func_names=list(trainer.reward_func_names), truncated=table[:, 0].bool(), lengths=table[:, 1],
            group_ids=(self._serial - 1) * N + torch.arange(N, dtype=torch.int64) // G, env=env))
        if self.probe_path is not None:
            self._keep_probe_rollouts(output)

    def _keep_probe_rollouts(self, output: dict) -> None:
        """Write the first rows of the first generation batch (prompt + completion ids) as the fixed
        rollouts that ``rlwatch postmortem --probe`` scores every checkpoint on; written once, off the
        training thread, never over an existing file."""
        path, self.probe_path = self.probe_path, None
        if path is None or os.path.exists(path) or not {"prompt_ids", "prompt_mask"} <= set(output):
            return
        n = self.probe_rows
        prompt_mask = output["prompt_mask"][:n].detach().to("cpu", torch.long)
        completion_mask = output["completion_mask"][:n].detach().to("cpu", torch.long)
        input_ids = torch.cat([output["prompt_ids"][:n].detach().cpu(), output["completion_ids"][:n].detach().cpu()], 1)
        attention = torch.cat([prompt_mask, completion_mask], 1)
        response = torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1)
        errors = self.watch.errors

        def write() -> None:
            from ..postmortem.probe import save_rollouts

            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                save_rollouts(path, input_ids, attention, response)
            except Exception as exc:  # noqa: BLE001 - a failed side file must not touch training
                errors.report("integration", "trl_probe_rollouts", f"{type(exc).__name__}: {exc}", exc=exc)

        threading.Thread(target=write, name="rlwatch-probe-rollouts", daemon=True).start()

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
            version=inputs[VERSION_KEY], trainer_version=int(self.trainer.state.global_step)))

    # -- one step --

    def step_fields(self, micro: list[MicroBatch]) -> dict[str, Any]:
        """The token-level fields of ``Watch.observe`` for one optimizer step's micro-batches."""
        width = max(int(m.mask.shape[1]) for m in micro)
        fields: dict[str, Any] = {
            "mask": _cat_tokens([m.mask for m in micro], width),
            "trainer_logp": _cat_tokens([m.trainer_logp for m in micro], width),
            "seq_version": torch.cat([m.version.reshape(-1) for m in micro]),
            "trainer_version": micro[-1].trainer_version,
        }
        if all(m.sampler_logp is not None for m in micro):
            fields["sampler_logp"] = _cat_tokens([m.sampler_logp for m in micro], width)
        else:
            self.listener.unavailable[("mismatch", "no_sampler_logprobs")] = 1.0
        if all(m.entropy is not None for m in micro):
            fields["entropy"] = _cat_tokens([m.entropy for m in micro], width)
        else:
            self.listener.unavailable[("entropy", "not_computed")] = 1.0
        fields.update(sampling_fields(self.trainer))
        return fields

    def generation_fields(self, generations: list[Generation]) -> dict[str, Any]:
        """Episode-level fields of the generation batches scored in one step, as one record: a mask of
        each completion's length, rewards, group ids, truncation, failures, environments."""
        lengths = torch.cat([g.lengths for g in generations])
        width = max(int(lengths.max()) if lengths.numel() else 0, 1)
        fields: dict[str, Any] = {
            "mask": torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1),
            "rewards": torch.cat([g.rewards for g in generations]),
            "group_ids": torch.cat([g.group_ids for g in generations]),
            "truncated": torch.cat([g.truncated for g in generations]),
            "failed": [f for g in generations for f in g.failed],
        }
        if all(g.env is not None for g in generations):
            fields["env"] = [e for g in generations for e in g.env]
        return fields

    def generation_values(self, step: int, generations: list[Generation]) -> dict:
        """Every episode-level signal of the batches, computed together on the whole (gathered) batches."""
        from ..signals import compute_step
        from ..watch import _few_threads_for

        record = self._builder.build(step, self.generation_fields(generations))
        if record is None:
            return {}
        # A few hundred rows: on the training thread (no rlwatch thread) one intra-op thread, as observe does.
        inline = getattr(self.watch, "_worker", None) is None
        with _few_threads_for(record.mask) if inline else contextlib.nullcontext():
            computed = compute_step(record, self.watch.config)
        values = {name: family for name, family in computed.items() if name in GENERATION_FAMILIES}
        values["generation"] = {(): float(generations[-1].serial)}
        values["generation_policy_version"] = {(): float(generations[-1].version)}
        if any(g.env is None for g in generations):
            self.listener.unavailable[("env", "no_environment_column")] = 1.0
        if all(torch.isnan(g.rewards).all() for g in generations):
            self.listener.unavailable[("reward", "all_unscorable")] = 1.0
        return values

    def reward_scalars(self, generations: list[Generation]) -> dict[str, float]:
        """Per-function reward means of the batches (functions that returned None excluded, as TRL's
        ``rewards/<func>/mean``), overall and, with an environment column, per environment (at most
        ``MAX_ENV_SCALARS`` names per run, so that TRL's own logged scalars keep their place under the
        Watch's name cap)."""
        names = generations[0].func_names
        rows = [r for g in generations for r in g.per_func.tolist()]          # N x F floats
        envs = [e for g in generations for e in g.env] if all(g.env is not None for g in generations) else None
        out: dict[str, float] = {}
        for j, name in enumerate(names):
            _put_mean(out, f"rlwatch/rewards/{name}/mean", [r[j] for r in rows])
            if envs is None:
                continue
            by_env: dict[str, list[float]] = {}
            for r, env in zip(rows, envs):
                by_env.setdefault(env, []).append(r[j])
            for env, values in by_env.items():
                key = f"rlwatch/rewards/{name}/{env}/mean"
                if key in self._env_scalars or len(self._env_scalars) < MAX_ENV_SCALARS:
                    if _put_mean(out, key, values):
                        self._env_scalars.add(key)
        return out

    def flush(self, step: int) -> None:
        """Observe the optimizer step that just ended: take the step's micro-batches and scored
        generation batches, and hand assembling and computing them to ``Watch.defer`` (rlwatch's
        thread with ``background=True``, else done right here on the training thread)."""
        micro, self.capture.micro = self.capture.micro, []
        generations, self.capture.generations = self.capture.generations, []
        if micro or generations:
            self.watch.defer(lambda: guarded(self.watch, "trl_observe")(self.observe_step)(step, micro, generations))

    def observe_step(self, step: int, micro: list[MicroBatch], generations: list[Generation] | None = None) -> None:
        if generations:
            values = guarded(self.watch, "trl_generation_signals")(self.generation_values)(step, generations)
            if values:
                self.listener.submit(values)
            self.watch.log_scalars(step, self.reward_scalars(generations))
        if micro:
            self.watch.observe(step, **self.step_fields(micro))


# --- small pure helpers ------------------------------------------------------------------------------

def eos_and_pad(trainer: Any) -> set[int]:
    """Token ids that end a completion normally (TRL's ``eos_and_pad``)."""
    ids = {int(i) for i in trainer.eos_token_ids}
    pad = trainer._tokenizer.pad_token_id
    if pad is not None:
        ids.add(int(pad))
    return ids


def truncation_flags(completion_ids_list: list, end_ids: set[int]) -> torch.Tensor:
    """[B] bool: the completion's last token is not EOS/pad, i.e. generation hit the length limit.

    Uses the unpadded completions (like TRL's ``completions/clipped_ratio``), never the padded width.
    """
    return torch.tensor([len(ids) > 0 and int(ids[-1]) not in end_ids for ids in completion_ids_list],
                        dtype=torch.bool)


class AuditedReward:
    """A reward function paired with an independent checker (:func:`audited`). TRL calls it like the
    reward function; the checker's verdict per completion (True = really correct, False = wrong,
    None = cannot tell) reaches rlwatch's ``verifier_disagreement`` detector as ``true_pass``."""

    def __init__(self, reward_fn: Callable, checker: Callable, name: str | None = None) -> None:
        self.reward_fn = reward_fn
        self.checker = checker
        self.__name__ = name or getattr(reward_fn, "__name__", "reward")
        self.last_verdicts: list[bool | None] | None = None

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list:
        rewards = self.reward_fn(prompts=prompts, completions=completions, **kwargs)
        try:
            verdicts = self.checker(prompts=prompts, completions=completions, **kwargs)
            self.last_verdicts = [None if v is None else bool(v) for v in verdicts]
        except Exception as exc:  # noqa: BLE001 - a broken checker never changes the rewards
            logger.warning("rlwatch: checker of %s failed: %s", self.__name__, exc)
            self.last_verdicts = None
        return rewards


def audited(reward_fn: Callable, checker: Callable, name: str | None = None) -> AuditedReward:
    """Pair a TRL reward function with an independent checker: ``reward_funcs=[audited(reward, check)]``.
    The checker takes the same arguments (prompts, completions, dataset columns) and returns one
    verdict per completion; training uses only the reward."""
    return AuditedReward(reward_fn, checker, name)


def _text(value: Any) -> str:
    """A prompt or completion as text (plain strings, or chat messages)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in value)
    return str(value)


def audit_verdicts(trainer: Any, n: int) -> list[bool | None]:
    """The verdicts of the :class:`AuditedReward` checkers on the last ``n`` completions scored."""
    verdicts: list[bool | None] = [None] * n
    for func in trainer.reward_funcs:
        if isinstance(func, AuditedReward) and func.last_verdicts is not None:
            verdicts = [v if v is not None else old for v, old in zip(func.last_verdicts, verdicts)]
    return verdicts


def episodes(trainer: Any, prompts: list, completions: list, completion_ids_list: list, per_func: torch.Tensor,
             truncated: torch.Tensor, env: list[str] | None,
             verdicts: list[bool | None] | None = None) -> list[dict[str, Any]]:
    """One episode per completion for the reward-hack detectors: text, ids, weighted reward, the reward
    components per function and, for :class:`AuditedReward` functions, the checker's verdict."""
    names = list(trainer.reward_func_names)
    weights = trainer.reward_weights.detach().to("cpu", torch.float64)
    rewards = (per_func * weights).nansum(dim=1).tolist()
    components = per_func.tolist()
    if verdicts is None:
        verdicts = audit_verdicts(trainer, len(completions))
    out = []
    for i, completion in enumerate(completions):
        extra: dict[str, Any] = {"reward_components": {n: c for n, c in zip(names, components[i]) if c == c}}
        if verdicts[i] is not None:
            extra["true_pass"] = verdicts[i]
        out.append({"env": env[i] if env else "default", "reward": rewards[i], "prompt": _text(prompts[i]),
                    "response": _text(completion), "response_ids": list(completion_ids_list[i]),
                    "truncated": bool(truncated[i]), "extra": extra})
    return out


def judges_hacks(watch: Any) -> bool:
    """Whether a run's Watches judge reward hacks: the ``hack_detectors`` option, which (unlike
    ``Watch.hack_detection``) reads the same on exporting and non-exporting processes."""
    return getattr(getattr(watch, "options", None), "hack_detectors", None) is not False


def hack_episode_inputs(trainer: Any, prompts: list, completions: list, completion_ids_list: list,
                        per_func: torch.Tensor, truncated: torch.Tensor, env: list[str] | None) -> tuple:
    """This process's share of :func:`episodes`' inputs as plain picklable values (for ``gather_object``):
    prompts, completions, ids, [B, F] reward rows, [B] truncation, [B] environments, [B] checker verdicts."""
    return (list(prompts), list(completions), [[int(i) for i in ids] for ids in completion_ids_list],
            per_func.tolist(), truncated.tolist(),
            list(env) if env is not None else ["default"] * len(completions),
            audit_verdicts(trainer, len(completions)))


def merge_episode_inputs(parts: list[tuple]) -> tuple:
    """:func:`episodes`' arguments (after the trainer) for the processes' shares, concatenated in order."""
    prompts, completions, ids, rows, truncated, env, verdicts = ([x for part in parts for x in part[k]]
                                                                 for k in range(7))
    return (prompts, completions, ids, torch.tensor(rows, dtype=torch.float64).reshape(len(ids), -1),
            torch.tensor(truncated, dtype=torch.bool), env, verdicts)


def env_labels(inputs: list[dict]) -> list[str] | None:
    """The environment of each dataset row, from the first of ``ENV_COLUMNS`` present."""
    if not inputs:
        return None
    for column in ENV_COLUMNS:
        if column in inputs[0]:
            return [str(row.get(column)) for row in inputs]
    return None


def env_labels_present(trainer: Any) -> bool:
    """Whether the training dataset has an environment column (the same answer on every process)."""
    columns = getattr(getattr(trainer, "train_dataset", None), "column_names", None) or []
    return any(column in columns for column in ENV_COLUMNS)


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


def _cat_tokens(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """Concatenate [b_i, T_i] tensors along the batch, right-padding to ``width`` with zeros."""
    padded = [t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]))
              for t in tensors]
    return padded[0] if len(padded) == 1 else torch.cat(padded)


def _put_mean(out: dict[str, float], name: str, values: list[float]) -> bool:
    """Store the mean of the non-NaN values under ``name``; False when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    if finite:
        out[name] = sum(finite) / len(finite)
    return bool(finite)


# --- guard actions -----------------------------------------------------------------------------------

_requests: dict[str, set[str]] = {}
_requests_lock = threading.Lock()


def _request(event: Any, what: str) -> None:
    with _requests_lock:
        _requests.setdefault(str(getattr(event, "run", "")), set()).add(what)


def _take_requests(run: str) -> set[str]:
    with _requests_lock:
        return _requests.pop(run, set())


def stop_on_critical(event: Any) -> None:
    """Guard action: stop training cleanly (``control.should_training_stop``) at the next callback.

    Use as ``Watch(guard=(stop_on_critical,))`` or ``watch(trainer, guard=(stop_on_critical,))``."""
    _request(event, "stop")
    logger.warning("rlwatch: critical alert %s: requesting TRL to stop training", getattr(event, "name", "?"))


def save_on_critical(event: Any) -> None:
    """Guard action: save a checkpoint (``control.should_save``) at the next callback."""
    _request(event, "save")
    logger.warning("rlwatch: critical alert %s: requesting a TRL checkpoint", getattr(event, "name", "?"))


# --- the callback ------------------------------------------------------------------------------------

class RLWatchCallback(TrainerCallback):
    """TRL/transformers callback: observe each optimizer step, forward logs and checkpoints, apply
    guard requests.

    Usable on its own in ``GRPOTrainer(..., callbacks=[RLWatchCallback(watch)])``: at train begin it
    finds its trainer and attaches the per-token capture. ``sync_guard=True`` all-reduces guard
    requests across processes at each step end (needed with guard actions on more than one process;
    set it identically on every rank).
    """

    def __init__(self, watch: Any, instrumentor: GRPOInstrumentor | None = None, sync_guard: bool = False) -> None:
        self.watch = watch
        self.instrumentor = instrumentor
        self.sync_guard = sync_guard
        self.trainer: Any = None if instrumentor is None else instrumentor.trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            trainer = _find_trainer()
            if trainer is not None:
                attach(trainer, self.watch, callback=self)
            else:
                logger.warning("rlwatch: RLWatchCallback could not find its trainer; only logs, checkpoints and "
                               "guards are recorded (use rlwatch.integrations.trl.watch(trainer))")
        return self._apply(control)

    def on_step_end(self, args, state, control, **kwargs):
        if self.instrumentor is not None:
            guarded(self.watch, "trl_observe")(self.instrumentor.flush)(int(state.global_step))
        return self._apply(control, sync=True)

    def on_substep_end(self, args, state, control, **kwargs):
        return self._apply(control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.watch.log_scalars(int(state.global_step), _trainer_logs.without_headline(logs))
        return self._apply(control)

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.watch.record_checkpoint(int(state.global_step), path)
        return self._apply(control)

    def on_train_end(self, args, state, control, **kwargs):
        guarded(self.watch, "trl_flush")(self.watch.flush)()
        return control

    def _apply(self, control, sync: bool = False):
        requests = _take_requests(self.watch.run)
        if sync and self.sync_guard:
            requests = guarded(self.watch, "trl_guard_sync")(self._all_reduce)(requests) or requests
        if "stop" in requests:
            control.should_training_stop = True
        if "save" in requests:
            control.should_save = True
        return control

    def _all_reduce(self, requests: set[str]) -> set[str]:
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is None or accelerator.num_processes <= 1:
            return requests
        flags = torch.tensor([float("stop" in requests), float("save" in requests)], device=accelerator.device)
        flags = accelerator.reduce(flags, reduction="sum")
        return {name for name, v in zip(("stop", "save"), flags.tolist()) if v > 0}


def _find_trainer() -> Any:
    """The GRPOTrainer whose training loop is calling us (walks up the caller frames)."""
    return caller_self(sys._getframe(1), lambda obj: _is_grpo(obj) or _is_async(obj), 16)


def _is_grpo(obj: Any) -> bool:
    return any(cls.__name__ == "GRPOTrainer" for cls in type(obj).__mro__)


def _is_async(obj: Any) -> bool:
    return any(cls.__name__ == "AsyncGRPOTrainer" for cls in type(obj).__mro__)


# --- public entry points -----------------------------------------------------------------------------

@dataclass
class _Attachment:
    watch: Any
    callback: RLWatchCallback
    instrumentor: GRPOInstrumentor | None
    added_callback: bool
    owns_watch: bool


_attached: "weakref.WeakKeyDictionary[Any, _Attachment]" = weakref.WeakKeyDictionary()


def attach(trainer: Any, watch: Any, callback: RLWatchCallback | None = None, owns_watch: bool = False,
           sync_guard: bool = False, probe_rollouts: bool = True, trainer_logs: bool = True) -> bool:
    """Attach an existing Watch to ``trainer``. False (one warning, nothing patched) when the
    installed TRL is outside the supported range or the trainer is already watched.

    ``probe_rollouts``: keep the first 32 sequences of the first generation batch in
    ``<output_dir>/rlwatch-probe-rollouts.safetensors`` for ``rlwatch postmortem --probe``.
    ``trainer_logs``: add the headline signals to TRL's own logs (:func:`mirror_into_log`)."""
    if trainer in _attached:
        logger.warning("rlwatch: this trainer is already watched; ignoring the second call")
        return False
    _take_requests(watch.run)                 # a request left over from an earlier run of that name
    instrumentor: GRPOInstrumentor | None = None
    if _is_async(trainer) or not _is_grpo(trainer):
        logger.warning("rlwatch: %s is watched through its callbacks only (logs, checkpoints, guards); the "
                       "per-token capture supports trl.GRPOTrainer", type(trainer).__name__)
    else:
        instrumentor = GRPOInstrumentor(trainer, watch)
        output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
        if probe_rollouts and output_dir and watch.active:
            instrumentor.probe_path = os.path.join(output_dir, ROLLOUTS_FILE)
        try:
            if not instrumentor.instrument():
                return False
        except Exception as exc:  # noqa: BLE001 - a trainer we cannot patch must still train
            watch.errors.report("integration", "trl_instrument", f"{type(exc).__name__}: {exc}", exc=exc)
            return False
    added = callback is None
    if callback is None:
        callback = RLWatchCallback(watch, instrumentor, sync_guard=sync_guard)
        trainer.add_callback(callback)
    else:
        callback.instrumentor, callback.trainer = instrumentor, trainer
    _attached[trainer] = _Attachment(watch, callback, instrumentor, added, owns_watch)
    if trainer_logs and _trainer_logs.enabled():
        mirror_into_log(trainer, watch)
    return True


def mirror_into_log(trainer: Any, watch: Any) -> None:
    """Add the headline signals (``rlwatch/kl_k3``, ``rlwatch/is_ess``, ...; see
    ``rlwatch.integrations._trainer_logs``) to every training log of ``trainer``: its ``log`` is
    wrapped on the instance, so they reach ``state.log_history`` and every ``report_to`` backend
    (W&B, TensorBoard, MLflow). Evaluation logs and the end-of-training summary are left alone.
    Undone by :func:`unwatch`."""
    original = trainer.log
    if getattr(original, "__rlwatch_mirror__", False):
        return

    def log(logs: dict, *args: Any, **kwargs: Any) -> Any:
        if isinstance(logs, dict) and "train_runtime" not in logs and not any(str(k).startswith("eval_") for k in logs):
            logs = guarded(watch, "trl_trainer_logs")(_trainer_logs.merged)(logs, watch) or logs
        return original(logs, *args, **kwargs)

    log.__rlwatch_mirror__ = True
    trainer.log = log


def _unmirror_log(trainer: Any) -> None:
    if getattr(vars(trainer).get("log"), "__rlwatch_mirror__", False):
        del trainer.log


def watch(trainer: Any, **watch_options: Any):
    """Create a :class:`rlwatch.Watch` for a TRL ``GRPOTrainer`` and attach it. Returns the Watch.

    ``watch_options`` go to ``Watch`` (``run``, ``port``, ``store``, ``guard``, ...), except
    ``probe_rollouts`` (default True, see :func:`attach`) and ``trainer_logs`` (default True: the
    headline signals join TRL's logs under ``rlwatch/``, see :func:`mirror_into_log`); defaults
    here: ``background=True`` when the trainer runs on an accelerator (each step is assembled and
    computed on rlwatch's thread, so the training thread never waits for the device's queue), False
    on CPU (where that thread would only compete with the trainer's own threads for the same cores:
    measured slower, see ``bench/bench_trl_overhead.py``) and with a ``guard`` (which must act at
    the step that fired),
    ``framework="trl"``, the installed TRL version, ``group_size=num_generations`` and the TRL
    settings that shape the signals as run metadata. A second call on the same trainer warns and
    returns the first Watch. On an unsupported TRL version the Watch is returned unattached (one
    warning, nothing patched).
    """
    from ..watch import Watch

    existing = _attached.get(trainer)
    if existing is not None:
        logger.warning("rlwatch: this trainer is already watched; returning its Watch")
        return existing.watch
    version = _base.installed_version("trl") or ""
    watch_options.setdefault("framework", "trl")
    watch_options.setdefault("framework_version", version)
    num_generations = getattr(trainer, "num_generations", None)
    if num_generations:
        watch_options.setdefault("group_size", int(num_generations))
    output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
    if output_dir:
        # The run store next to the checkpoints: `rlwatch postmortem <output_dir>` finds both.
        watch_options.setdefault("store", os.path.join(output_dir, "rlwatch.db"))
        watch_options.setdefault("run", getattr(trainer.args, "run_name", None) or os.path.basename(
            os.path.normpath(output_dir)))
    metadata = dict(watch_options.pop("metadata", None) or {})
    metadata.setdefault("trl", trainer_metadata(trainer))
    probe_rollouts = bool(watch_options.pop("probe_rollouts", True))
    trainer_logs = bool(watch_options.pop("trainer_logs", True))
    watch_options.setdefault("background", not watch_options.get("guard") and trainer_device(trainer) != "cpu")
    w = Watch(metadata=metadata, **watch_options)
    attach(trainer, w, owns_watch=True, sync_guard=bool(watch_options.get("guard")), probe_rollouts=probe_rollouts,
           trainer_logs=trainer_logs)
    return w


def trainer_device(trainer: Any) -> str | None:
    """The device type the trainer trains on ("cpu", "cuda", ...), None when it cannot be told."""
    device = getattr(getattr(trainer, "accelerator", None), "device", None)
    if device is None:
        try:
            device = trainer.args.device
        except Exception:  # noqa: BLE001 - an unusual trainer: unknown
            return None
    return getattr(device, "type", None)


def unwatch(trainer: Any, close: bool = True) -> None:
    """Undo :func:`watch` / :func:`attach`: restore the trainer's methods, remove the callback that was
    added, and close the Watch that :func:`watch` created (unless ``close=False``)."""
    attachment = _attached.pop(trainer, None)
    if attachment is None:
        return
    _unmirror_log(trainer)
    if attachment.instrumentor is not None:
        attachment.instrumentor.uninstrument()
    attachment.callback.instrumentor = None
    if attachment.added_callback:
        trainer.remove_callback(attachment.callback)
    if attachment.owns_watch and close:
        attachment.watch.close()


def trainer_metadata(trainer: Any) -> dict[str, Any]:
    """The TRL settings that decide how the signals read (stored with the run)."""
    args = getattr(trainer, "args", None)
    names = ("num_generations", "num_iterations", "steps_per_generation", "gradient_accumulation_steps",
             "per_device_train_batch_size", "max_completion_length", "beta", "loss_type", "scale_rewards",
             "use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_max", "mask_truncated_completions", "temperature", "top_p", "top_k")
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, (bool, int, float, str)) or value is None:
            if not (isinstance(value, float) and not math.isfinite(value)):
                out[name] = value
    return out


__all__ = ["watch", "unwatch", "attach", "audited", "AuditedReward", "RLWatchCallback", "GRPOInstrumentor",
           "stop_on_critical", "save_on_critical"]
