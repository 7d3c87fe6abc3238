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

**Two granularities** (README, "TRL: where each signal comes from"), one module each: token-level
signals once per optimizer step over every micro-batch of that step's loss (``grpo``: the patch
table, its hooks, ``GRPOInstrumentor.step_fields``); episode-level ones once per generation batch,
on the whole gathered batch (``generation``: :class:`Generation`), exported with the step that
scored it and repeated on steps that score none (:class:`GenerationSignals`). ``generation`` also
reads truncation, environments and :func:`audited` checkers; ``callback`` holds :func:`watch`,
:func:`attach`, :func:`unwatch`, :class:`RLWatchCallback` and the guard actions.

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

Cost: one host transfer per step (``Watch.observe_fields``) and one per generation batch (its episode
signals), besides a copy of the rewards to the host where TRL reads them anyway.

``trl.experimental.async_grpo.AsyncGRPOTrainer`` is a different trainer (packed tree-attention
batches from a vLLM server); only its logs, checkpoints and guards are handled here.
"""

from .callback import (RLWatchCallback, attach, mirror_into_log, save_on_critical, stop_on_critical,  # noqa: F401
                       trainer_device, trainer_metadata, unwatch, watch)
from .generation import (ENV_COLUMNS, GENERATION_FAMILIES, MAX_ENV_SCALARS, PROBE_ROWS,  # noqa: F401
                         STEP_EPISODE_FAMILIES, UNSCORABLE, VERSION_KEY, AuditedReward, Generation, GenerationSignals,
                         audit_verdicts, audited, env_labels, env_labels_present, eos_and_pad, episodes,
                         truncation_flags, hack_episode_inputs, judges_hacks, merge_episode_inputs)
from .grpo import (GATHER_ONLY, PATCHES, SUPPORTED, GRPOInstrumentor, MicroBatch, _cat_tokens,  # noqa: F401
                   sampling_fields)

__all__ = ["watch", "unwatch", "attach", "audited", "AuditedReward", "RLWatchCallback", "GRPOInstrumentor",
           "stop_on_critical", "save_on_critical"]
