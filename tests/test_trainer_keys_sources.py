"""The recognised names of the frameworks rlwatch does not install (SkyRL, slime, open-instruct,
prime-rl, ms-swift), tested against the keys as their own source writes them to the tracker. Each row below is
quoted from the file and commit named with it (read with ``git show COMMIT:PATH``); a key is written
here as the tracker receives it (slime's and prime-rl's ``train/`` prefix included)."""

from __future__ import annotations

import pytest

from rlwatch.core.trainer_keys import TRAINER_KEYS, recognise

#: framework -> (repository, commit, [(logged key, rlwatch signal, source path)]).
SOURCES: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "SkyRL": ("NovaSky-AI/SkyRL", "a9564572eb8e91076be43c1bd5e4615e3de17265", [
        # trainer.py prefixes the worker's status with "policy/" (train_critic_and_policy)
        ("policy/grad_norm", "grad_norm", "skyrl/train/trainer.py"),
        ("policy/policy_loss", "loss", "skyrl/backends/skyrl_train/workers/worker.py"),
        ("policy/policy_entropy", "entropy_mean", "skyrl/backends/skyrl_train/workers/worker.py"),
        ("policy/policy_lr", "learning_rate", "skyrl/backends/skyrl_train/workers/worker.py"),
        ("policy/policy_kl", "ref_kl", "skyrl/backends/skyrl_train/workers/worker.py"),
        ("policy/loss_metrics/clip_ratio", "clip_fraction", "skyrl/backends/skyrl_train/utils/ppo_utils.py"),
        ("loss/avg_kl", "ref_kl", "skyrl/train/trainer.py"),
        ("reward/avg_raw_reward", "reward_mean", "skyrl/train/trainer.py"),
        ("generate/avg_num_tokens", "response_length_mean", "skyrl/train/generators/utils.py"),
        ("generate/max_num_tokens", "response_length_max", "skyrl/train/generators/utils.py"),
        ("eval/all/avg_score", "heldout_score", "skyrl/train/evaluate.py"),
    ]),
    "slime": ("THUDM/slime", "624b824a898ab0ec1fcb4d373004c7f3852bf515", [
        # model.py: log_dict = {f"train/{role_tag}{key}": ... for key in loss_dict} (role_tag "" for the actor)
        ("train/ppo_kl", "policy_kl", "slime/backends/megatron_utils/loss.py"),
        ("train/pg_clipfrac", "clip_fraction", "slime/backends/megatron_utils/loss.py"),
        ("train/entropy_loss", "entropy_mean", "slime/backends/megatron_utils/loss.py"),
        ("train/pg_loss", "loss", "slime/backends/megatron_utils/loss.py"),
        ("train/kl_loss", "ref_kl", "slime/backends/megatron_utils/loss.py"),
        ("train/grad_norm", "grad_norm", "slime/backends/megatron_utils/model.py"),
        ("train/lr-pg_0", "learning_rate", "slime/backends/megatron_utils/model.py"),
        ("rollout/raw_reward", "reward_mean", "slime/observability/train_metric_utils.py"),
        ("rollout/response_len/mean", "response_length_mean", "slime/observability/rollout_metrics.py"),
        ("rollout/response_len/max", "response_length_max", "slime/observability/rollout_metrics.py"),
        ("rollout/truncated_ratio", "truncated_ratio", "slime/observability/rollout_metrics.py"),
        ("eval/aime", "heldout_score", "slime/observability/rollout_metrics.py"),     # eval/{data set}
    ]),
    "open-instruct": ("allenai/open-instruct", "e6c3044aa6201c8bfa4573c1b03142af599e730d", [
        ("objective/kl3_avg", "ref_kl", "open_instruct/grpo_utils.py"),
        ("loss/policy_avg", "loss", "open_instruct/grpo_utils.py"),
        ("policy/clipfrac_avg", "clip_fraction", "open_instruct/grpo_utils.py"),
        ("policy/entropy_avg", "entropy_mean", "open_instruct/grpo_utils.py"),
        ("optim/grad_norm", "grad_norm", "open_instruct/grpo_fast.py"),
        ("lr", "learning_rate", "open_instruct/grpo_fast.py"),
        ("scores", "reward_mean", "open_instruct/data_loader.py"),
        ("val/sequence_lengths", "response_length_mean", "open_instruct/data_loader.py"),
        ("val/sequence_lengths_max", "response_length_max", "open_instruct/data_loader.py"),
        ("eval/scores", "heldout_score", "open_instruct/grpo_utils.py"),
    ]),
    "prime-rl": ("PrimeIntellect-ai/prime-rl", "559b44772e471d1538537b8805cc77f3824a5e64", [
        ("entropy/all/mean", "entropy_mean", "src/prime_rl/trainer/rl/train.py"),
        ("mismatch_kl/all/mean", "mismatch_kl_k3", "src/prime_rl/trainer/rl/train.py"),
        ("loss/mean", "loss", "src/prime_rl/trainer/rl/train.py"),
        ("optim/grad_norm", "grad_norm", "src/prime_rl/trainer/rl/train.py"),
        ("optim/lr", "learning_rate", "src/prime_rl/trainer/rl/train.py"),
        # orchestrator.py: to_wandb(prefix="train/agg", subset) -> {prefix}/{subset}/{agent}/{stat}/mean
        ("train/agg/all/num_output_tokens/mean", "response_length_mean", "src/prime_rl/orchestrator/metrics.py"),
        ("train/agg/all/num_output_tokens/max", "response_length_max", "src/prime_rl/orchestrator/metrics.py"),
        ("train/agg/all/math-agent/reward/mean", "reward_mean", "src/prime_rl/orchestrator/metrics.py"),
        ("train/agg/all/math-agent/is_truncated/mean", "truncated_ratio", "src/prime_rl/orchestrator/metrics.py"),
        ("eval/gsm8k/all/math-agent/avg@4", "heldout_score", "src/prime_rl/orchestrator/orchestrator.py"),
    ]),
    # ms-swift's own names and the TRL names it logs too (its GRPOTrainer subclasses TRL's and averages its
    # _metrics in log(); an evaluation's keys get "eval_"), as they reach logging.jsonl and the trackers
    "ms-swift": ("modelscope/ms-swift", "ff5128777dd3dc5538f1a95fbcc29442c327d7d2", [     # v4.5.2
        ("reward", "reward_mean", "swift/rlhf_trainers/grpo_trainer.py"),
        ("frac_reward_zero_std", "zero_std_ratio", "swift/rlhf_trainers/grpo_trainer.py"),
        ("kl", "ref_kl", "swift/rlhf_trainers/grpo_trainer.py"),                   # beta > 0: k3 to the reference
        ("completions/mean_length", "response_length_mean", "swift/rlhf_trainers/grpo_trainer.py"),
        ("completions/max_length", "response_length_max", "swift/rlhf_trainers/grpo_trainer.py"),
        ("completions/clipped_ratio", "truncated_ratio", "swift/rlhf_trainers/grpo_trainer.py"),
        ("clip_ratio/region_mean", "clip_fraction", "swift/rlhf_trainers/grpo_trainer.py"),
        ("clip_ratio", "clip_fraction", "swift/rlhf_trainers/grpo_trainer.py"),    # use_liger_kernel
        ("entropy/mean", "entropy_mean", "swift/rlhf_trainers/grpo_trainer.py"),   # log_entropy
        ("rollout_correction/k3_kl", "mismatch_kl_k3", "swift/rlhf_trainers/grpo_trainer.py"),
        ("rollout_correction/kl", "mismatch_kl_k1", "swift/rlhf_trainers/grpo_trainer.py"),
        ("eval_reward", "heldout_score", "swift/rlhf_trainers/grpo_trainer.py"),
        # SwiftMixin._maybe_log_save_evaluate: {'loss': ...} (loss first), 'grad_norm', 'learning_rate'
        ("loss", "loss", "swift/trainers/mixin.py"),
        ("grad_norm", "grad_norm", "swift/trainers/mixin.py"),
        ("learning_rate", "learning_rate", "swift/trainers/mixin.py"),
    ]),
}

CASES = [(fw, key, signal) for fw, (_, _, rows) in SOURCES.items() for key, signal, _ in rows]


@pytest.mark.parametrize("framework,key,signal", CASES, ids=[f"{f}:{k}" for f, k, _ in CASES])
def test_each_frameworks_own_key_gives_its_signal(framework, key, signal):
    assert recognise({key: 0.375}) == pytest.approx({signal: 0.375, **_flags(signal)})


def _flags(signal: str) -> dict[str, float]:
    return {"grad_norm": {"grad_norm_nonfinite": 0.0, "grad_norm_zero": 0.0},
            "loss": {"loss_nonfinite": 0.0}}.get(signal, {})


@pytest.mark.parametrize("framework", list(SOURCES))
def test_a_whole_row_as_the_framework_logs_it_gives_every_signal_once(framework):
    """All of one framework's keys in one row, with the neighbours its source logs beside them (which
    must not be read as a signal): each signal gets its own key's value."""
    _, _, rows = SOURCES[framework]
    row = {key: 0.01 * (i + 1) for i, (key, _, _) in enumerate(rows)}
    neighbours = {"eval/step": 40.0, "eval/aime-truncated_ratio": 0.9, "eval/aime-pass@16": 0.95,
                  "train/agg/effective/math-agent/reward/mean": 7.0, "train/gsm8k/all/math-agent/reward/mean": 8.0,
                  "eval/gsm8k/all/math-agent/policy_version": 9.0, "val/stop_rate": 0.5}
    got = recognise({**row, **neighbours})
    expected: dict[str, float] = {}
    for key, signal, _ in rows:
        expected.setdefault(signal, row[key])          # the first listed of one signal (SkyRL's two ref KLs)
    for signal, value in expected.items():
        assert got[signal] == pytest.approx(value), (framework, signal)


def test_the_table_and_the_docs_name_each_framework_and_its_commit():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "trainer-dynamics.md").read_text()
    for framework, (repo, commit, rows) in SOURCES.items():
        assert f"`{repo}` @ `{commit}`" in text, framework
        assert {e.framework for e in TRAINER_KEYS if e.framework == framework}, framework
        for _, _, path in rows:
            assert path.rsplit("/", 1)[-1] in text, (framework, path)


def test_openrlhfs_names_are_its_installed_sources_keys():
    """OpenRLHF's names in the installed package's own source (its environment, ``.venv-openrlhf``):
    each exact key written as a string literal where OpenRLHF builds its logged status; the held-out
    pattern matches the name its evaluation logs."""
    import re
    import subprocess

    from ._replay_helpers import openrlhf_python
    from .conftest import REQUIRE_FRAMEWORKS

    python = openrlhf_python()
    if python is None:
        missing = "OpenRLHF's environment (.venv-openrlhf, `make openrlhf-venv`) is not set up"
        pytest.fail(missing) if REQUIRE_FRAMEWORKS else pytest.skip(missing)
    script = ("import importlib.util, pathlib; "
              "root = pathlib.Path(importlib.util.find_spec('openrlhf').origin).parent; "
              "print('\\n'.join(p.read_text() for p in sorted((root / 'trainer').rglob('*.py'))))")
    source = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120, check=True,
                            env={"PATH": "/usr/bin:/bin"}).stdout
    assert "class PPOTrainer" in source
    entries = [e for e in TRAINER_KEYS if e.framework == "OpenRLHF"]
    assert len(entries) >= 6
    for entry in entries:
        if entry.key:
            assert f'"{entry.key}"' in source, entry.key
            assert recognise({entry.key: 0.5})[entry.signal] == 0.5
        else:   # the evaluation's f"eval_{data source}_pass1" (or without a data source)
            names = re.findall(r'f?"(eval_[^"]*pass1)"', source)
            assert names, "OpenRLHF's evaluation names"
            assert any(entry.matches(n.replace("{", "").replace("}", "")) for n in names), names
