#!/usr/bin/env bash
# OpenRLHF 0.11.x GRPO (group_norm) with vLLM, monitored by rlwatch.
#
# rlwatch rides along in Ray's worker_process_setup_hook: every Ray worker of the job runs
# rlwatch.integrations.openrlhf.setup_hook, which only installs an import hook. The one process
# that trains (OpenRLHF's PPOTrainer actor; TrainingActor with --train.async_enable) serves
# /metrics on RLWATCH_PORT and registers itself in RLWATCH_SD_DIR for Prometheus' file_sd.
# Every node needs rlwatch installed (pip install rlwatch[openrlhf]) next to OpenRLHF.
#
#   ray start --head --node-ip-address 0.0.0.0 --num-gpus 8      # once per cluster, as usual
#   bash examples/openrlhf_launch.sh
#
# RLWATCH_EXAMPLE_PRINT=1 prints the runtime env and OpenRLHF's arguments instead of launching
# (tests/test_openrlhf_lifecycle.py checks them against OpenRLHF's own argument parser).
set -euo pipefail

RUN="${RLWATCH_RUN:-qwen2.5-1.5b-grpo}"
SD_DIR="${RLWATCH_SD_DIR:-/shared/rlwatch-targets}"   # a directory Prometheus reads through file_sd

# The job's runtime env: Ray merges it with the env_vars OpenRLHF's own ray.init passes.
RUNTIME_ENV=$(cat <<EOF
{
  "working_dir": "${OPENRLHF_WORKDIR:-.}",
  "worker_process_setup_hook": "rlwatch.integrations.openrlhf.setup_hook",
  "env_vars": {
    "RLWATCH_RUN": "${RUN}",
    "RLWATCH_PORT": "9400",
    "RLWATCH_ADDR": "0.0.0.0",
    "RLWATCH_SD_DIR": "${SD_DIR}"
  }
}
EOF
)

OPENRLHF_ARGS=(
  --actor.model_name_or_path Qwen/Qwen2.5-1.5B-Instruct
  --actor.num_nodes 1 --actor.num_gpus_per_node 8
  --ref.num_nodes 1 --ref.num_gpus_per_node 8
  --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.6
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep
  --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 --data.input_key context_messages
  --data.label_key label --data.apply_chat_template --data.max_len 4096
  --reward.remote_url /path/to/reward_func.py
  --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --rollout.max_new_tokens 2048
  --rollout.micro_batch_size 16 --train.batch_size 1024 --train.micro_batch_size 4
  --algo.advantage.estimator group_norm --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3
  # vLLM's log-probs come back only with importance-sampling correction on: that is what gives
  # rlwatch the sampler side of the mismatch signals (0.11.0: --algo.advantage.is_correction_enable).
  --algo.advantage.is_correction_level token
  --actor.adam.lr 5e-7 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
  --ckpt.path ./ckpt/qwen-grpo --ckpt.save_steps 20 --ckpt.save_hf
  --logger.wandb.run_name "${RUN}"
)

if [[ "${RLWATCH_EXAMPLE_PRINT:-0}" == "1" ]]; then
  printf '%s\n' "${RUNTIME_ENV}"
  printf '%s\0' "${OPENRLHF_ARGS[@]}" > "${RLWATCH_EXAMPLE_ARGS_FILE:-/dev/stderr}"
  exit 0
fi

ray job submit --address="${RAY_DASHBOARD_ADDRESS:-http://127.0.0.1:8265}" --runtime-env-json="${RUNTIME_ENV}" \
  -- python3 -m openrlhf.cli.train_ppo_ray "${OPENRLHF_ARGS[@]}"

# Without a Ray job server, the launcher does the same (a new local Ray instance, or the cluster in
# RAY_ADDRESS), keeping OpenRLHF's own ray.init environment:
#   RLWATCH_RUN="${RUN}" RLWATCH_SD_DIR="${SD_DIR}" python -m rlwatch.integrations.openrlhf "${OPENRLHF_ARGS[@]}"
# or the zero-code bootstrap:
#   rlwatch run --run "${RUN}" -- python3 -m openrlhf.cli.train_ppo_ray "${OPENRLHF_ARGS[@]}"
