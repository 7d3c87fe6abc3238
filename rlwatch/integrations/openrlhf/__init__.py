"""rlwatch for OpenRLHF 0.11.x (``pip install rlwatch[openrlhf]``).

OpenRLHF's training loop runs inside Ray actors (``PPOTrainer``; with ``--train.async_enable`` a
``TrainingActor`` and a ``GenerateSamplesActor``), never in the process that runs
``python -m openrlhf.cli.train_ppo_ray``, so a patch made in the launcher does not reach it. Ray's
``worker_process_setup_hook`` does. OpenRLHF calls ``ray.init`` itself only when Ray is not
initialised yet, with a fixed ``runtime_env``; three ways to attach rlwatch:

* ``ray job submit`` (OpenRLHF's documented launch): put the hook in the job's runtime env; Ray
  merges it with the ``env_vars`` that OpenRLHF's own ``ray.init`` passes::

      ray job submit --address=http://127.0.0.1:8265 --runtime-env-json='{
          "worker_process_setup_hook": "rlwatch.integrations.openrlhf.setup_hook",
          "env_vars": {"RLWATCH_RUN": "my-run", "RLWATCH_SD_DIR": "/shared/rlwatch-targets"}}' \\
        -- python3 -m openrlhf.cli.train_ppo_ray ...

  (checked on CPU with Ray 2.55: ``ray start --head`` then ``ray job submit`` of a driver that runs
  OpenRLHF's CLI up to its ``ray.init``; a worker then sees the wrapped methods and RLWATCH_RUN.)

* the launcher (:mod:`.launcher`), which initialises Ray (a new local instance, or the cluster named by
  ``RAY_ADDRESS``) with the hook, OpenRLHF's default ``env_vars`` and every ``RLWATCH_*`` variable,
  then runs OpenRLHF's CLI unchanged (its ``ray.init`` is then skipped)::

      RLWATCH_RUN=my-run python -m rlwatch.integrations.openrlhf --actor.model_name_or_path ... (OpenRLHF's arguments)

  (not under ``ray job submit`` with the hook already in the job's runtime env: Ray refuses two
  values for the same runtime_env field).

* ``rlwatch run -- python -m openrlhf.cli.train_ppo_ray ...`` (zero-code bootstrap, which extends
  every ``ray.init`` the same way). See ``examples/openrlhf_launch.sh``.

When the trainer runs in your own process instead, call :func:`instrument` before building it.

Submodules: ``instrumentor`` (what is wrapped and the hooks), ``launcher`` (the Ray launcher), ``samples``
(the policy-version clocks, dispatch stamps, data sources) and ``experiences`` (a step's ``Experience``
batches -> its fields and the detectors' episodes).

Which process exports (see ``_ray_actors.RayActorInstrumentor``)
    A training step is observed only in the single-controller trainer process (``PPOTrainer``, or
    ``TrainingActor`` in async mode): exactly one process per job exports. The sample generator (the
    same process in sync mode, ``GenerateSamplesActor`` in async mode) only stamps each sample with
    a policy version, its data source and finish reason.

What is wrapped (``PATCHES``; every patch is ``_instrumentor.Instrumentor.wrap``)
    * ``openrlhf.trainer.ppo_trainer.BasePPOTrainer.train_step(rollout_samples, global_step)``:
      marks a training step (step number ``global_step + 1``, the number OpenRLHF logs and names
      its checkpoints with) and reads the trainer's policy version before the step's own update.
    * ``openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.make_experience_batch``:
      its list of ``Experience`` batches is turned into one ``Watch.observe`` per training step,
      made when ``train_step`` returns, with the phases OpenRLHF timed in it (``timing/make_experience``,
      ``timing/ppo_train``, ``timing/broadcast`` -> make_experience, training, sync) and the
      generation phase (``SamplesGenerator.generate_samples``, timed here as ``fit`` times it).
    * ``BasePPOTrainer.broadcast_to_vllm``: OpenRLHF has no policy version anywhere, so rlwatch
      keeps its own: the number of weight broadcasts to the vLLM engines so far (``TrainingActor``
      overrides the method and calls this one, so async mode counts the same way).
    * ``openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator._dispatch_prompts_to_vllm``
      and ``._process_response_into_experience``: each sample is stamped with the version when
      its prompt was sent to vLLM and the version when its response was collected (kept in an
      attribute of the ``Experience`` that OpenRLHF never reads), its data source and finish reason.
    * ``BasePPOTrainer.save_logs_and_checkpoints(global_step, logs_dict, client_states)``: every
      scalar OpenRLHF logs is mirrored with ``watch.log_scalars`` (``rlwatch_framework_metric``),
      the headline signals join ``logs_dict`` (``rlwatch/`` keys, see ``_trainer_logs``), and the
      checkpoint written at ``ckpt.save_steps`` is recorded with ``watch.record_checkpoint``.
    * ``SamplesGenerator._generate_vllm``: the samples it processed but did not return (dynamic
      filtering) are the next step's dropped episodes (``samples.Filtered``).
    * ``openrlhf.datasets.prompts_dataset.PromptDataset.__init__``: remembers the dataset so that a
      prompt's ``datasource`` column can be found again (OpenRLHF drops it from training samples).

Field mapping (``Experience`` -> ``Watch.observe``)
    action_mask -> mask; action_log_probs (the trainer's pi_old, DeepSpeed forward) ->
    trainer_logp; rollout_log_probs (vLLM's processed log-probs, present only with importance-
    sampling correction on: 0.11.2 ``--algo.advantage.is_correction_level token|seq``, 0.11.0
    ``--algo.advantage.is_correction_enable``) -> sampler_logp; rewards (after OpenRLHF's length
    penalties, before the group baseline: what it logs as ``rollout/reward_mean``) -> rewards;
    ``index // rollout.n_samples_per_prompt`` (OpenRLHF's own grouping in
    ``compute_advantages_and_returns``) -> group_ids; the dataset's ``datasource`` column -> env;
    vLLM finish reason ``length`` -> truncated (0.11.0's multi-turn agent executor does not report
    it: there a sample counts as truncated when it filled the context, ``total_length >= max_len``,
    which is where that executor stops); (dispatch version, collection version) -> seq_version
    [B, 2] against trainer_version = the broadcasts done when the step starts. The two stamps
    bracket the weights a sample saw: in async mode with ``--train.partial_rollout_enable`` a
    broadcast can land while a sample is being generated, and rlwatch cannot see the token at which
    it happened (vLLM does not report it), so per-token versions are not available. Agent
    ``extra_logs`` (per-sample ``info`` entries) -> ``log_scalars`` as ``extra_logs/<name>``
    (batch mean). Sampling temperature/top_p/top_k come from the generate call.

Configuration
    The RLWATCH_* variables of ``rlwatch.core.config.env_watch_options`` (through ``runtime_env.env_vars``); the run
    defaults to ``--logger.wandb.run_name``, the group size to ``rollout.n_samples_per_prompt``
    (RLWATCH_GROUP_SIZE=0: no group-size check). With importance-sampling correction on, the
    masked-IS band of the mismatch signals is OpenRLHF's ``--algo.advantage.is_correction_threshold``.
"""

from .instrumentor import (EXPERIENCE_MAKER, INSTRUMENTOR, PATCHES, PPO_TRAINER, PROMPTS_DATASET,  # noqa: F401
                           SAMPLES_GENERATOR, SUPPORTED, AUTOLOAD, OpenRLHFInstrumentor, checkpoint_dir, instrument,
                           is_correction_on, setup_hook, uninstrument, watch_options_from_env)
from .launcher import HOOK, OPENRLHF_ENV_DEFAULTS, launch, ray_runtime_env  # noqa: F401
from .samples import META, LocalClock, RayClock, sample_meta  # noqa: F401

__all__ = ["OpenRLHFInstrumentor", "instrument", "uninstrument", "setup_hook", "launch", "ray_runtime_env",
           "watch_options_from_env", "sample_meta", "INSTRUMENTOR", "HOOK", "META"]
