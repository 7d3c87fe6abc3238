#!/usr/bin/env bash
# Launch a verl 0.9.x GRPO run with rlwatch watching it.
#
# verl runs its trainer loop inside a Ray actor (TaskRunner), not in this process, so rlwatch is
# delivered with Ray's worker_process_setup_hook: the one override that matters is
#
#   +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rlwatch.integrations.verl.setup_hook
#
# main_ppo merges ray_kwargs.ray_init.runtime_env over its defaults and passes it to ray.init. The
# hook runs in every Ray worker but only installs an import hook; the one process that computes the
# step metrics (the trainer actor) starts the /metrics endpoint and the run store on first use.
#
# rlwatch is configured with RLWATCH_* variables, given to the workers through the runtime_env
# (exported shell variables only reach workers when main_ppo starts a local Ray itself):
#   RLWATCH_RUN        run label (default: trainer.experiment_name)
#   RLWATCH_PORT       /metrics port (default 9400; taken -> next free one, see RLWATCH_PORT_FALLBACK)
#   RLWATCH_ADDR       bind address (default 127.0.0.1; 0.0.0.0 when Prometheus runs on another host)
#   RLWATCH_SD_DIR     file_sd directory Prometheus watches (`rlwatch up` prints it): Ray puts the
#                      trainer actor on any node, so this is how Prometheus finds it
#   RLWATCH_DIR        run store directory (default ./rlwatch-runs in the actor's working dir)
#   RLWATCH_STORE=none, RLWATCH_STALENESS_BOUND, RLWATCH_GROUP_SIZE, RLWATCH_STRICT, RLWATCH_DISABLE=1
# Quote numbers ("9400"): Hydra would turn them into ints, and Ray accepts only string env_vars.
#
# Requirements: rlwatch importable in every Ray worker (pip install 'rlwatch[verl]' in the job's
# environment, or add its path to PYTHONPATH in env_vars), verl 0.9.x.
set -euo pipefail

RUN=${RUN:-qwen2.5-0.5b-grpo-gsm8k}
SD_DIR=${SD_DIR:-$PWD/.rlwatch-stack/targets}      # `rlwatch up` creates and watches this directory
DATA=${DATA:-$HOME/data/gsm8k}                     # verl's examples/data_preprocess/gsm8k.py output
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.logger='["console"]' \
    trainer.project_name=rlwatch-demo \
    trainer.experiment_name="$RUN" \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.total_epochs=1 \
    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rlwatch.integrations.verl.setup_hook \
    +ray_kwargs.ray_init.runtime_env.env_vars.RLWATCH_RUN="$RUN" \
    '+ray_kwargs.ray_init.runtime_env.env_vars.RLWATCH_PORT="9400"' \
    +ray_kwargs.ray_init.runtime_env.env_vars.RLWATCH_SD_DIR="$SD_DIR" \
    "$@"

# actor_rollout_ref.rollout.calculate_log_probs=True makes the rollout return its own log-probs
# (rollout_log_probs): without them there is no sampler/trainer mismatch to measure.
