"""The TRL integration's episode-level path: once per generation batch, on the whole batch gathered
over processes (whole GRPO groups), exported with the optimizer step that scored it; and what it
reads about episodes: truncation, environments, the checkers of :func:`audited` rewards, and the
episodes handed to the reward-hack detectors."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...core.fields import StepFields
from ...core.metrics import CATALOGUE

logger = logging.getLogger("rlwatch")

#: Dataset columns read as the environment label, first match wins.
ENV_COLUMNS = ("environment", "env", "data_source")
UNSCORABLE = "unscorable"
#: Key added to TRL's generation batch (one entry per sample, so it survives shuffling/splitting).
VERSION_KEY = "rlwatch_version"
#: What a ``rollout_func`` (or any sampler behind one) returns next to ``completion_ids`` to say which
#: policy sampled: per completion (a list) or for the whole batch (one int), the trainer's
#: ``state.global_step`` whose weights the sampler held. TRL forwards it to the reward functions as a
#: column (they take ``**kwargs``); rlwatch stamps the samples with it instead of the step at generation,
#: so that the version lag shows the sampler's own staleness (a sampler that missed weight syncs).
POLICY_VERSION_KEY = "policy_version"
#: Per-environment per-function reward scalars kept per run (the Watch keeps 256 scalar names).
MAX_ENV_SCALARS = 64
#: Sequences of the first generation batch kept for ``rlwatch postmortem --probe``.
PROBE_ROWS = 32
#: Families computed once per generation batch (whole groups): the episode-level ones of the catalogue
#: but the reward-hack detectors' (judged on the step) and the rollout system's (TRL's batches carry no
#: per-episode durations or dropped episodes); gauges among them are repeated on steps that score no
#: batch, counters count each batch once.
GENERATION_FAMILIES = frozenset(spec.name for spec in CATALOGUE
                                if spec.level == "episode" and "detector" not in spec.labels
                                and spec.group != "rollout")
#: What the token-level step record says about its own episodes; replaced by the generation's values.
STEP_EPISODE_FAMILIES = frozenset({"response_length_mean", "response_length_p95", "response_length_p99",
                                   "response_length_max", "env_episodes", "episodes_total"})


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


def judges_hacks(watch: Any) -> bool:
    """Whether a run's Watches judge reward hacks: the ``hack_detectors`` option, which (unlike
    ``Watch.hack_detection``) reads the same on exporting and non-exporting processes."""
    return getattr(getattr(watch, "watch_config", None), "hack_detectors", None) is not False


def hack_episode_inputs(trainer: Any, prompts: list, completions: list, completion_ids_list: list,
                        per_func: torch.Tensor, truncated: torch.Tensor, env: list[str] | None,
                        verdicts: list[bool | None] | None = None) -> tuple:
    """One process's share of :func:`episodes`' inputs as plain picklable values (for ``gather_object``):
    prompts, completions, ids, [B, F] reward rows, [B] truncation, [B] environments, [B] checker
    verdicts (``verdicts``, else read now: the next reward call replaces them)."""
    return (list(prompts), list(completions), [[int(i) for i in ids] for ids in completion_ids_list],
            per_func.tolist(), truncated.tolist(),
            list(env) if env is not None else ["default"] * len(completions),
            verdicts if verdicts is not None else audit_verdicts(trainer, len(completions)))


def episodes(trainer: Any, parts: list[tuple]) -> list[dict[str, Any]]:
    """One episode per completion of the processes' shares (:func:`hack_episode_inputs`, in process
    order) for the reward-hack detectors: text, ids, weighted reward, the reward components per
    function and, for :class:`AuditedReward` functions, the checker's verdict."""
    prompts, completions, ids, rows, truncated, env, verdicts = ([x for part in parts for x in part[k]]
                                                                 for k in range(7))
    names = list(trainer.reward_func_names)
    weights = trainer.reward_weights.detach().to("cpu", torch.float64)
    per_func = torch.tensor(rows, dtype=torch.float64).reshape(len(ids), len(names))
    rewards = (per_func * weights).nansum(dim=1).tolist()
    out = []
    for i, completion in enumerate(completions):
        extra: dict[str, Any] = {"reward_components": {n: c for n, c in zip(names, rows[i]) if c == c}}
        if verdicts[i] is not None:
            extra["true_pass"] = verdicts[i]
        out.append({"env": env[i], "reward": rewards[i], "prompt": _text(prompts[i]), "response": _text(completion),
                    "response_ids": ids[i], "truncated": bool(truncated[i]), "extra": extra})
    return out


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


@dataclass
class Generation:
    """Episode-level data of one whole generation batch, gathered over processes (N rows, host)."""

    serial: int                           # 1-based count of this run's generation batches
    version: int                          # state.global_step when generated, or the oldest policy_version
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
        from ...core.values import ADDITIVE_KINDS, StepValues, kind_of

        for name in STEP_EPISODE_FAMILIES:
            values.pop(name, None)
        with self._lock:
            pending, self._pending = self._pending, []
        extra = StepValues()
        for batch in pending:                  # normally one: a step's batches are computed together
            extra.merge(batch)
        if pending:
            self._gauges = {name: family for name, family in extra.items() if kind_of(name) not in ADDITIVE_KINDS}
        else:
            extra.merge(self._gauges)
        if self.unavailable:
            extra["signal_unavailable_total"] = dict(self.unavailable)
            self.unavailable = {}
        return extra

    def close(self) -> None:
        with self._lock:
            self._pending.clear()


class GenerationPath:
    """The episode-level half of :class:`~.grpo.GRPOInstrumentor` (a mixin: it uses the instrumentor's
    ``trainer``, ``watch``, ``capture``, ``listener``, ``_builder``, ``_serial``, ``_env_scalars``,
    ``probe_path`` and ``probe_rows``): gather, keep and compute each scored generation batch."""

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
        self.watch.defer(lambda: self.watch.submit_episodes(step, episodes(trainer, whole)))

    def _on_generation(self, output: dict) -> None:
        """Stamp the batch with the policy version; keep its episode-level data for the step's flush."""
        trainer, captured = self.trainer, self.capture.rewards
        self.capture.rewards = None
        if not trainer.model.training or captured is None:
            return
        completion_ids = output["completion_ids"]
        B = int(completion_ids.shape[0])
        sampled = sampler_versions(captured.get("policy_version"), B, self.watch.errors)
        version = int(trainer.state.global_step) if sampled is None else int(sampled.min())
        output[VERSION_KEY] = (torch.full((B,), version, dtype=torch.int64) if sampled is None else sampled
                               ).to(completion_ids.device)
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
            from ...postmortem.probe import save_rollouts

            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                save_rollouts(path, input_ids, attention, response)
            except Exception as exc:  # noqa: BLE001 - a failed side file must not touch training
                errors.report("integration", "trl_probe_rollouts", f"{type(exc).__name__}: {exc}", exc=exc)

        threading.Thread(target=write, name="rlwatch-probe-rollouts", daemon=True).start()

    def generation_fields(self, generations: list[Generation]) -> StepFields:
        """Episode-level fields of the generation batches scored in one step, as one record: a mask of
        each completion's length, rewards, group ids, truncation, failures, environments."""
        lengths = torch.cat([g.lengths for g in generations])
        width = max(int(lengths.max()) if lengths.numel() else 0, 1)
        return StepFields(
            mask=torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1),
            rewards=torch.cat([g.rewards for g in generations]),
            group_ids=torch.cat([g.group_ids for g in generations]),
            truncated=torch.cat([g.truncated for g in generations]),
            failed=[f for g in generations for f in g.failed],
            env=[e for g in generations for e in g.env] if all(g.env is not None for g in generations) else None)

    def generation_values(self, step: int, generations: list[Generation]) -> dict:
        """Every episode-level signal of the batches, computed together on the whole (gathered) batches."""
        from ...core.threads import few_threads_for
        from ...signals import compute_step

        record = self._builder.build(step, self.generation_fields(generations))
        if record is None:
            return {}
        # A few hundred rows: on the training thread (no rlwatch thread) one intra-op thread, as observe does.
        inline = getattr(self.watch, "_worker", None) is None
        with few_threads_for(record.mask) if inline else contextlib.nullcontext():
            computed = compute_step(record, self.watch.signal_config)
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


def reported_versions(inputs: list[dict]) -> list | None:
    """The ``policy_version`` a ``rollout_func`` returned, as TRL forwarded it into each sample's inputs
    (None when it returned none)."""
    versions = [inp.get(POLICY_VERSION_KEY) if isinstance(inp, dict) else None for inp in inputs]
    return versions if any(v is not None for v in versions) else None


def sampler_versions(versions: list | None, B: int, errors: Any) -> torch.Tensor | None:
    """[B] int64: the policy version that sampled each completion, from a ``rollout_func``'s
    ``policy_version`` (None without one, or when it is not one whole number per completion: counted)."""
    if versions is None:
        return None
    try:
        out = torch.tensor([int(v) for v in versions], dtype=torch.int64)
        if len(versions) != B or any(float(v) != int(v) for v in versions):
            raise ValueError(f"{len(versions)} values for {B} completions")
        return out
    except (TypeError, ValueError, OverflowError) as exc:
        errors.report("validate", "policy_version", f"the rollout_func's {POLICY_VERSION_KEY!r} is not one whole "
                      f"number per completion ({exc}); the step at generation is used", field=POLICY_VERSION_KEY,
                      raise_in_strict=False)
        return None


def _put_mean(out: dict[str, float], name: str, values: list[float]) -> bool:
    """Store the mean of the non-NaN values under ``name``; False when there are none."""
    finite = [v for v in values if not math.isnan(v)]
    if finite:
        out[name] = sum(finite) / len(finite)
    return bool(finite)

