"""The trainer metric names rlwatch recognises: which key each framework logs for each of rlwatch's
dynamics signals, and :func:`recognise`, which turns one logged row into those signals' values.

``Watch.log_scalars(step, mapping)`` (and so the TRL, verl and OpenRLHF integrations, which mirror the
trainer's own logs through it) reads every row through :func:`recognise`: the recognised values become
the step's values (stored, exported, judged by the alerts), the rest stay framework scalars. A key is
matched after a leading ``train/`` (the prefix trackers such as W&B put on TRL's and OpenRLHF's training
logs). When several keys of one row name the same signal, the first in :data:`TRAINER_KEYS` wins (a
framework's own name before a generic one); a pattern's matches are averaged (verl logs one held-out
score per data source). The table is documented in docs/trainer-dynamics.md.

Only logged aggregates whose definition is the same as rlwatch's signal are mapped onto it (verl's
``rollout_corr/k3_kl`` is rlwatch's k3 over the same tokens, and so is ms-swift's
``rollout_correction/k3_kl``, computed by a port of verl's code); the other mismatch aggregates verl and
ms-swift log (``training/rollout_probs_diff_mean``, ``rollout_corr/log_ppl_abs_diff``,
``rollout_correction/chi2_token``, ...) are differently defined and stay framework scalars under their own name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

#: The prefixes a tracker puts before a training key (W&B and TensorBoard: ``train/grad_norm``).
PREFIXES = ("train/",)


@dataclass(frozen=True)
class TrainerKey:
    """One logged name: ``key`` (exact) or ``pattern`` (a regular expression matched in full), the
    rlwatch ``signal`` (catalogue name) it gives, the ``framework`` that logs it, and a ``note``."""

    signal: str
    framework: str
    key: str = ""
    pattern: str = ""
    note: str = ""

    def matches(self, name: str) -> bool:
        return name == self.key if self.key else re.fullmatch(self.pattern, name) is not None


_T = TrainerKey
#: Every recognised name, in priority order per signal.
TRAINER_KEYS: tuple[TrainerKey, ...] = (
    # --- policy KL between consecutive policies (the update's size) ---
    _T("policy_kl", "verl", "actor/ppo_kl", note="mean (log pi_old - log pi_new) over the update's tokens"),
    _T("policy_kl", "OpenRLHF", "ppo_kl"),
    _T("policy_kl", "generic", "approx_kl"),
    _T("policy_kl", "generic", "policy_kl"),
    _T("policy_kl", "slime", "ppo_kl", note="logged as train/ppo_kl: mean (log pi_old - log pi_new)"),
    # --- KL to the reference policy (the penalty term, not the update) ---
    _T("ref_kl", "TRL", "kl", note="GRPOTrainer, beta > 0: KL to the reference model"),
    _T("ref_kl", "verl", "actor/kl_loss", note="use_kl_loss: KL to the reference policy"),
    _T("ref_kl", "verl", "actor/reward_kl_penalty", note="KL penalty in the reward"),
    _T("ref_kl", "SkyRL", "policy/policy_kl", note="use_kl_loss: KL to the base model, not the update"),
    _T("ref_kl", "SkyRL", "loss/avg_kl", note="KL penalty in the reward"),
    _T("ref_kl", "slime", "kl_loss", note="logged as train/kl_loss (use_kl_loss)"),
    _T("ref_kl", "open-instruct", "objective/kl3_avg", note="k3 estimate of the KL to the reference"),
    # --- gradient norm (before clipping), loss ---
    _T("grad_norm", "TRL", "grad_norm", note="transformers Trainer; also OpenRLHF's short status"),
    _T("grad_norm", "verl", "actor/grad_norm"),
    _T("grad_norm", "OpenRLHF", "actor_grad_norm"),
    _T("grad_norm", "SkyRL", "policy/grad_norm"),
    _T("grad_norm", "slime", "grad_norm", note="logged as train/grad_norm"),
    _T("grad_norm", "open-instruct", "optim/grad_norm"),
    _T("grad_norm", "prime-rl", "optim/grad_norm"),
    _T("loss", "TRL", "loss"),
    _T("loss", "verl", "actor/pg_loss"),
    _T("loss", "OpenRLHF", "policy_loss"),
    _T("loss", "SkyRL", "policy/policy_loss"),
    _T("loss", "slime", "pg_loss", note="logged as train/pg_loss"),
    _T("loss", "open-instruct", "loss/policy_avg"),
    _T("loss", "prime-rl", "loss/mean"),
    # --- PPO clip fraction ---
    _T("clip_fraction", "TRL", "clip_ratio/region_mean", note="tokens clipped on either side"),
    _T("clip_fraction", "verl", "actor/pg_clipfrac"),
    _T("clip_fraction", "OpenRLHF", "ppo_clip_ratio"),
    _T("clip_fraction", "SkyRL", "policy/loss_metrics/clip_ratio", note="tokens whose ratio was clipped"),
    _T("clip_fraction", "slime", "pg_clipfrac", note="logged as train/pg_clipfrac"),
    _T("clip_fraction", "open-instruct", "policy/clipfrac_avg"),
    _T("clip_fraction", "generic", "clip_fraction"),
    _T("clip_fraction", "generic", "clipfrac"),
    _T("clip_fraction", "ms-swift", "clip_ratio", note="use_liger_kernel: tokens clipped on either side (Liger's "
       "GRPO loss)"),
    # --- entropy ---
    _T("entropy_mean", "TRL", "entropy", note="mean token entropy of the completions"),
    _T("entropy_mean", "verl", "actor/entropy"),
    _T("entropy_mean", "SkyRL", "policy/policy_entropy"),
    _T("entropy_mean", "slime", "entropy_loss", note="logged as train/entropy_loss: the mean token entropy"),
    _T("entropy_mean", "open-instruct", "policy/entropy_avg"),
    _T("entropy_mean", "prime-rl", "entropy/all/mean"),
    _T("entropy_mean", "ms-swift", "entropy/mean", note="log_entropy: mean over completions of each completion's "
       "mean token entropy"),
    # --- response length and the clipped (truncated) ratio ---
    _T("response_length_mean", "TRL", "completions/mean_length"),
    _T("response_length_mean", "verl", "response_length/mean"),
    _T("response_length_mean", "OpenRLHF", "response_length"),
    _T("response_length_mean", "SkyRL", "generate/avg_num_tokens"),
    _T("response_length_mean", "slime", "rollout/response_len/mean"),
    _T("response_length_mean", "open-instruct", "val/sequence_lengths", note="mean response length"),
    _T("response_length_mean", "prime-rl", "agg/all/num_output_tokens/mean", note="logged as train/agg/..."),
    _T("response_length_max", "TRL", "completions/max_length"),
    _T("response_length_max", "verl", "response_length/max"),
    _T("response_length_max", "SkyRL", "generate/max_num_tokens"),
    _T("response_length_max", "slime", "rollout/response_len/max"),
    _T("response_length_max", "open-instruct", "val/sequence_lengths_max"),
    _T("response_length_max", "prime-rl", "agg/all/num_output_tokens/max", note="logged as train/agg/..."),
    _T("truncated_ratio", "TRL", "completions/clipped_ratio", note="completions cut at max_completion_length"),
    _T("truncated_ratio", "verl", "response_length/clip_ratio", note="responses at the maximum length"),
    _T("truncated_ratio", "slime", "rollout/truncated_ratio"),
    _T("truncated_ratio", "prime-rl", pattern=r"agg/all/[^/]+/is_truncated/mean", note="logged as train/agg/...; "
       "mean over agents"),
    # --- reward (training) and held-out score ---
    _T("reward_mean", "TRL", "reward", note="GRPOTrainer; OpenRLHF logs the same name"),
    _T("reward_mean", "verl", "critic/score/mean", note="the reward function's score"),
    _T("reward_mean", "verl", "critic/rewards/mean", note="score with any in-reward KL penalty"),
    _T("reward_mean", "SkyRL", "reward/avg_raw_reward"),
    _T("reward_mean", "slime", "rollout/raw_reward", note="the reward before any normalisation"),
    _T("reward_mean", "open-instruct", "scores"),
    _T("reward_mean", "prime-rl", pattern=r"agg/all/[^/]+/reward/mean", note="logged as train/agg/...; "
       "mean over agents"),
    _T("heldout_score", "TRL", "eval_reward"),
    _T("heldout_score", "verl", pattern=r"val-core/[^/]+/[^/]+/mean@\d+", note="mean over data sources"),
    _T("heldout_score", "OpenRLHF", pattern=r"eval_(?:.+_)?pass1", note="mean over data sources"),
    _T("heldout_score", "SkyRL", "eval/all/avg_score"),
    _T("heldout_score", "open-instruct", "eval/scores"),
    _T("heldout_score", "prime-rl", pattern=r"eval/[^/]+/all/[^/]+/avg@\d+", note="mean over environments"),
    _T("heldout_score", "slime", pattern=r"eval/(?!step$)(?!loss$)(?!scores$)(?![^/]*-pass@)(?![^/]*-truncated_ratio$)"
       r"[^/]+", note="eval/{data set}: mean over data sets"),
    # --- groups without a learning signal ---
    _T("zero_std_ratio", "TRL", "frac_reward_zero_std", note="share of completions in groups whose rewards are all "
       "equal (zero advantage)"),
    # --- the optimiser's learning rate (a warm-up moves the mismatch with it) ---
    _T("learning_rate", "TRL", "learning_rate", note="transformers Trainer"),
    _T("learning_rate", "verl", "actor/lr", note="the actor worker's lr, renamed under actor/"),
    _T("learning_rate", "OpenRLHF", "actor_lr"),
    _T("learning_rate", "SkyRL", "policy/policy_lr"),
    _T("learning_rate", "slime", "lr-pg_0", note="logged as train/lr-pg_0: the first parameter group's"),
    _T("learning_rate", "open-instruct", "lr"),
    _T("learning_rate", "prime-rl", "optim/lr"),
    # --- sampler-learner mismatch aggregates with rlwatch's definition ---
    _T("mismatch_kl_k3", "verl", "rollout_corr/k3_kl", note="mean exp(r) - r - 1, r = log pi_old - log mu"),
    _T("mismatch_kl_k1", "verl", "rollout_corr/kl", note="mean (log mu - log pi_old)"),
    _T("mismatch_kl_k3", "prime-rl", "mismatch_kl/all/mean", note="mean exp(r) - r - 1, r = log pi - log mu"),
    _T("mismatch_kl_k3", "ms-swift", "rollout_correction/k3_kl", note="verl's formula, r = log pi_old - log mu, "
       "each token's term capped at 10"),
    _T("mismatch_kl_k1", "ms-swift", "rollout_correction/kl", note="mean (log mu - log pi_old)"),
)

#: The signals :func:`recognise` may return besides the table's (counts of non-finite and zero values).
FLAGS = ("grad_norm_nonfinite", "grad_norm_zero", "loss_nonfinite")
#: Every signal a trainer's row can give.
SIGNALS: tuple[str, ...] = tuple(dict.fromkeys([k.signal for k in TRAINER_KEYS] + list(FLAGS)))


def _number(value: Any) -> float | None:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _unprefixed(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def recognise(mapping: Mapping[str, Any]) -> dict[str, float]:
    """``{rlwatch signal: value}`` from one logged row ``{key: number}`` (keys as the frameworks log them).

    Non-finite values are left out, except that a logged gradient norm or loss sets
    ``grad_norm_nonfinite`` / ``loss_nonfinite`` (1 when it is NaN or infinite, else 0) and a finite
    gradient norm sets ``grad_norm_zero`` (1 when exactly 0)."""
    numbers: dict[str, float] = {}
    for key, value in mapping.items():
        number = _number(value)
        if number is not None and isinstance(key, str):
            numbers.setdefault(_unprefixed(key), number)
    out: dict[str, float] = {}
    matched: dict[str, list[float]] = {}
    done: set[str] = set()
    for entry in TRAINER_KEYS:
        if entry.signal in done:
            continue
        found = ([numbers[entry.key]] if entry.key in numbers else []) if entry.key else \
            [v for k, v in numbers.items() if entry.matches(k)]
        if not found:
            continue
        done.add(entry.signal)
        if entry.signal in ("grad_norm", "loss"):
            flag = "grad_norm_nonfinite" if entry.signal == "grad_norm" else "loss_nonfinite"
            out[flag] = 0.0 if math.isfinite(found[0]) else 1.0
        finite = [v for v in found if math.isfinite(v)]
        if finite:
            matched[entry.signal] = finite
    for signal, values in matched.items():
        out[signal] = sum(values) / len(values)
    if "grad_norm" in out:
        out["grad_norm_zero"] = 1.0 if out["grad_norm"] == 0.0 else 0.0
    return out


def keys_for(signal: str) -> list[TrainerKey]:
    """The table's entries for one signal, in priority order."""
    return [k for k in TRAINER_KEYS if k.signal == signal]


__all__ = ["FLAGS", "PREFIXES", "SIGNALS", "TRAINER_KEYS", "TrainerKey", "keys_for", "recognise"]
