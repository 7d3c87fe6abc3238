"""``rlwatch replay`` on ms-swift's ``logging.jsonl``, in the form ms-swift's logging path writes it.

ms-swift is not installed with rlwatch; :class:`SwiftLog` writes what its path from ``GRPOTrainer.log`` to
the file writes, as read in ``modelscope/ms-swift`` at ``ff5128777dd3dc5538f1a95fbcc29442c327d7d2`` (v4.5.2), around
the real transformers ``Trainer.log`` and ``CallbackHandler`` it goes through:

1. ``swift/rlhf_trainers/grpo_trainer.py`` ``GRPOTrainer.log``: each ``self._metrics[mode]`` list averaged,
   ``eval_`` put before every key in an evaluation, ``logs.update(metrics)``, then ``super().log(logs,
   start_time)``; a training row's ``logs`` start as ``{'loss': ..., 'grad_norm': ..., 'learning_rate': ...}``
   (``swift/trainers/mixin.py`` ``SwiftMixin._maybe_log_save_evaluate``), an evaluation's as transformers'
   ``eval_loss`` and speed metrics;
2. transformers' ``Trainer.log`` (the installed one): ``epoch``, then ``callback_handler.on_log``;
3. ``swift/trainers/patcher.py`` ``PrinterCallbackNew.on_log``: ``add_train_message`` (``global_step/max_steps``
   as ``f'{state.global_step}/{state.max_steps}'``, ``elapsed_time``, ``remaining_time``, every float rounded
   to 8 places, ``memory(GiB)``, ``train_speed(s/it)``), then ``append_to_jsonl``;
4. ``swift/utils/io_utils.py`` ``JsonlWriter._append``: ``json.dumps(check_json_format(obj),
   ensure_ascii=False) + '\\n'`` appended to ``<output_dir>/logging.jsonl`` (``check_json_format`` in
   ``swift/utils/utils.py``: a value that is not a Python scalar, list or dict is written as its ``repr``).

When training ends, crashed or not, ``swift/pipelines/train/sft.py`` ``SwiftSft.train`` (``finally:``)
appends its summary (``last_model_checkpoint``, ``global_step``, ``log_history``, ...), with no step field.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlwatch.ops.cli import main
from rlwatch.replay import ReplayInputError, load, replay

from ._replay_helpers import DROP, STEPS
from .conftest import need_module

MEMORY_GIB = 61.37        # what get_max_reserved_memory() reports on a GPU (0 on this CPU: left out then)


def to_jsonl_line(obj) -> str:
    """One line as ms-swift's ``JsonlWriter`` writes it: JSON, non-ASCII kept, a value JSON cannot hold
    (a numpy scalar, a tensor) written as its ``repr``."""
    return json.dumps(obj, ensure_ascii=False, default=repr) + '\n'


class SwiftLog:
    """One ms-swift training process writing ``output_dir/logging.jsonl`` (a resumed one starts at
    ``start_step``, the checkpoint's ``global_step``, and appends to the same file)."""

    def __init__(self, output_dir: Path, max_steps: int, start_step: int = 0):
        from transformers import TrainingArguments
        from transformers.trainer_callback import (CallbackHandler, DefaultFlowCallback, PrinterCallback,
                                                   TrainerControl, TrainerState)

        log = self

        class PrinterCallbackNew(PrinterCallback):       # swift/trainers/patcher.py
            def on_log(self, args, state, control, logs=None, **kwargs):
                log.add_train_message(logs, state)
                log.append_to_jsonl(Path(args.output_dir) / 'logging.jsonl', logs)
                _ = logs.pop('total_flos', None)

        self.state = TrainerState(global_step=start_step, max_steps=max_steps)
        self.start_step, self.start_time = start_step, time.time()
        self.trainer = SimpleNamespace(
            state=self.state, control=TrainerControl(),
            args=TrainingArguments(output_dir=str(output_dir), report_to=[], logging_steps=1),
            callback_handler=CallbackHandler([DefaultFlowCallback(), PrinterCallbackNew()], None, None, None, None))
        self.path = output_dir / 'logging.jsonl'

    def add_train_message(self, logs, state) -> None:
        """The fields ms-swift's printer callback adds (``swift/trainers/patcher.py``): the step as
        ``"<global_step>/<max_steps>"``, elapsed and remaining time as text, floats rounded to 8 places,
        the peak memory and the speed."""
        elapsed = time.time() - self.start_time
        done = state.global_step - self.start_step
        speed = elapsed / done if done > 0 else 0.0
        logs['global_step/max_steps'] = f'{state.global_step}/{state.max_steps}'
        logs['elapsed_time'] = f'{round(elapsed)}s'
        logs['remaining_time'] = f'{round((state.max_steps - state.global_step) * speed)}s'
        logs.update({k: round(v, 8) for k, v in logs.items() if isinstance(v, float)})
        logs['memory(GiB)'] = MEMORY_GIB
        logs['train_speed(s/it)'] = round(speed, 6)

    @staticmethod
    def append_to_jsonl(path: Path, obj) -> None:
        """``JsonlWriter`` on the master rank: one line appended to ``logging.jsonl``."""
        with open(path, 'a', encoding='utf-8') as f:
            f.write(to_jsonl_line(obj))

    def _log(self, logs: dict, metrics: dict[str, list], mode: str) -> None:
        """GRPOTrainer.log: the metrics averaged (``eval_`` in evaluation), then transformers' Trainer.log."""
        from transformers import Trainer

        averaged = {key: sum(val) / len(val) for key, val in metrics.items()}
        if mode == 'eval':
            averaged = {f'eval_{key}': val for key, val in averaged.items()}
        logs.update(averaged)
        self.state.epoch = self.state.global_step / self.state.max_steps
        Trainer.log(self.trainer, logs)

    def train_step(self, values: dict, loss: float, grad_norm: float, lr: float) -> None:
        """One optimiser step logged (``logging_steps=1``): ``values`` are the step's ``_metrics['train']``."""
        self.state.global_step += 1
        self._log({'loss': loss, 'grad_norm': grad_norm, 'learning_rate': lr}, {k: [v] for k, v in values.items()},
                  'train')

    def evaluate(self, values: dict) -> None:
        self._log({'eval_loss': 0.0, 'eval_runtime': 41.2, 'eval_samples_per_second': 3.1,
                   'eval_steps_per_second': 0.2}, {k: [v] for k, v in values.items()}, 'eval')

    def end(self) -> None:
        """transformers' totals at the end of ``train`` and ms-swift's closing summary (also after a crash)."""
        if self.state.global_step == self.state.max_steps:
            self._log({'train_runtime': 812.4, 'train_samples_per_second': 0.9, 'train_steps_per_second': 0.07,
                       'total_flos': 0.0, 'train_loss': 0.01}, {}, 'train')
        self.append_to_jsonl(self.path, {
            'last_model_checkpoint': None, 'best_model_checkpoint': None, 'best_metric': None,
            'global_step': self.state.global_step, 'log_history': self.state.log_history, 'memory': MEMORY_GIB})


def grpo_metrics(step: int, shift: float = 0.0) -> dict:
    """A GRPO step's ``_metrics['train']`` under ms-swift's names: the reward rises to 0.8 by step 30 and
    collapses at :data:`DROP`; the rollout-correction entries as ``_compute_rollout_offpolicy_metrics``
    and ``_compute_is_correction_metrics`` name them; one custom metric a numpy float32, one a tensor
    (written as their repr)."""
    import numpy as np
    import torch

    reward = 0.1 + 0.7 * min(step, 30) / 30 if step < DROP else 0.05
    return {
        'completions/mean_length': 300.0 + step + shift, 'completions/min_length': 40.0,
        'completions/max_length': 1024.0, 'completions/clipped_ratio': 0.02,
        'rewards/AccuracyORM/mean': reward, 'rewards/AccuracyORM/std': 0.3,
        'reward': reward + shift, 'reward_std': 0.3, 'frac_reward_zero_std': 0.25, 'kl': 0.0012,
        'entropy/mean': 0.6 + 0.01 * (step % 3), 'entropy/max': 1.4, 'entropy/min': 0.1,
        'rollout_correction/kl': 1e-4, 'rollout_correction/k3_kl': 2e-4 + shift,
        'rollout_correction/log_ppl_abs_diff': 0.02, 'rollout_correction/chi2_token': 0.01,
        'rollout_correction/ess': 0.97, 'rollout_correction/is_weight_mean': 1.0,
        'clip_ratio/low_mean': 0.0, 'clip_ratio/high_mean': 0.001, 'clip_ratio/region_mean': 0.001,
        'custom/np_metric': np.float32(0.25), 'custom/tensor_metric': torch.tensor(0.5),
    }


def write_run(output_dir: Path, steps: int = STEPS, eval_every: int = 10) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    log = SwiftLog(output_dir, max_steps=steps)
    for step in range(1, steps + 1):
        log.train_step(grpo_metrics(step), loss=0.01 * (step % 5), grad_norm=0.3, lr=1e-6)
        if step % eval_every == 0:
            log.evaluate({'reward': 0.7 if step < DROP else 0.1, 'completions/mean_length': 280.0})
    log.end()
    return log.path


@pytest.fixture
def transformers_installed():
    need_module("transformers")


def test_the_log_is_read_row_for_row(tmp_path, transformers_installed):
    """Every step's row holds the numbers ms-swift wrote (its strings and the step field skipped, numpy and
    tensor reprs read as numbers), an evaluation's keys merged into its step's row, the totals and the
    closing summary left out."""
    path = write_run(tmp_path / "out")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["global_step/max_steps"] == f"1/{STEPS}" and isinstance(lines[0]["elapsed_time"], str)
    assert lines[0]["custom/np_metric"] == "np.float32(0.25)" and lines[0]["custom/tensor_metric"] == "tensor(0.5000)"
    assert "log_history" in lines[-1] and "train_runtime" in lines[-2]
    run = load(path)
    assert run.fmt == "ms-swift" and run.steps == list(range(1, STEPS + 1)) and run.log_every == 1
    row = run.rows[4]                                        # step 5
    expected = {k: round(v, 8) for k, v in grpo_metrics(5).items() if isinstance(v, float)}
    assert {k: row[k] for k in expected} == pytest.approx(expected)
    assert row["custom/np_metric"] == 0.25 and row["custom/tensor_metric"] == 0.5
    assert row["loss"] == 0.0 and row["grad_norm"] == 0.3 and row["memory(GiB)"] == MEMORY_GIB
    assert not {"elapsed_time", "remaining_time", "global_step/max_steps", "eval_reward"} & set(row)
    at_10 = run.rows[9]
    assert at_10["eval_reward"] == 0.7 and at_10["eval_runtime"] == 41.2
    assert at_10["reward"] == round(0.1 + 0.7 * 10 / 30, 8)
    assert not {"train_runtime", "best_metric", "global_step", "memory"} & set(run.keys)
    assert run.reward_key == "reward"


def test_msswifts_names_are_read_as_rlwatchs_signals(tmp_path, transformers_installed):
    """The TRL names ms-swift logs and its own (``entropy/mean``, ``rollout_correction/k3_kl`` and ``kl``);
    its other rollout-correction aggregates are listed as kept under their own names."""
    run = load(write_run(tmp_path / "out"))
    recognised = run.recognised()
    assert {k: recognised.get(k) for k in ("reward", "entropy/mean", "rollout_correction/k3_kl",
                                           "rollout_correction/kl", "kl", "eval_reward", "frac_reward_zero_std",
                                           "completions/mean_length", "clip_ratio/region_mean", "grad_norm")} == {
        "reward": "reward_mean", "entropy/mean": "entropy_mean", "rollout_correction/k3_kl": "mismatch_kl_k3",
        "rollout_correction/kl": "mismatch_kl_k1", "kl": "ref_kl", "eval_reward": "heldout_score",
        "frac_reward_zero_std": "zero_std_ratio", "completions/mean_length": "response_length_mean",
        "clip_ratio/region_mean": "clip_fraction", "grad_norm": "grad_norm"}
    assert run.kept_mismatch_aggregates() == ["rollout_correction/chi2_token", "rollout_correction/ess",
                                              "rollout_correction/is_weight_mean",
                                              "rollout_correction/log_ppl_abs_diff"]


def test_a_collapsed_run_is_replayed_to_its_collapse(tmp_path, transformers_installed, capsys):
    """The directory ms-swift wrote, given as is (its logging.jsonl, not a checkpoint's trainer_state.json
    that stops at the checkpoint): the collapse is named on the held-out ``eval_reward`` (preferred to the
    training reward, as for TRL), the mismatch k3 read as rlwatch's."""
    out = tmp_path / "out"
    write_run(out)
    (out / "checkpoint-20").mkdir()
    (out / "checkpoint-20" / "trainer_state.json").write_text('{"log_history": [{"step": 1, "reward": 0.1}]}')
    run = load(out)
    assert run.fmt == "ms-swift" and run.source.endswith("logging.jsonl")
    result = replay(run, store_dir=tmp_path / "stores")
    assert result.collapse_step == DROP and result.postmortem["quality_signal"] == "eval_reward"
    assert result.postmortem["peak"]["value"] == pytest.approx(0.7)
    assert main(["replay", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "logging.jsonl (ms-swift)" in printed and "rollout_correction/k3_kl as mismatch_kl_k3" in printed
    assert f"COLLAPSE of eval_reward at {DROP}" in printed and "  quality: eval_reward: the peak" in printed


def test_a_resumed_run_keeps_the_last_values_of_a_step_logged_twice(tmp_path, transformers_installed):
    """A run that logged steps 1-12 and crashed, resumed from checkpoint-10 into the same output directory
    (``--add_version false``): steps 11 and 12 are in the file twice; replay keeps the resumed run's values
    (the last logged, as for every format), each step once."""
    out = tmp_path / "out"
    out.mkdir()
    first = SwiftLog(out, max_steps=20)
    for step in range(1, 13):
        first.train_step(grpo_metrics(step), loss=0.01, grad_norm=0.3, lr=1e-6)
    first.end()                                              # the closing summary, written in `finally:`
    resumed = SwiftLog(out, max_steps=20, start_step=10)
    for step in range(11, 21):
        resumed.train_step(grpo_metrics(step, shift=0.001), loss=0.02, grad_norm=0.4, lr=1e-6)
    resumed.end()
    logged = [json.loads(line).get("global_step/max_steps") for line in out.joinpath("logging.jsonl").open()]
    assert logged.count("11/20") == 2 and logged.count("12/20") == 2
    run = load(out / "logging.jsonl")
    assert run.steps == list(range(1, 21))
    for step in (11, 12):
        row = run.rows[step - 1]
        assert row["rollout_correction/k3_kl"] == pytest.approx(2e-4 + 0.001) and row["loss"] == 0.02
        assert row["completions/mean_length"] == 300.0 + step + 0.001
    assert run.rows[9]["loss"] == 0.01                       # step 10, logged once


VALID = ('{"loss": 0.01, "grad_norm": 0.3, "learning_rate": 1e-06, "reward": 0.5, "epoch": 0.05, '
         '"global_step/max_steps": "1/20", "elapsed_time": "12s", "remaining_time": "3m 48s", '
         '"memory(GiB)": 61.37, "train_speed(s/it)": 12.0}')


@pytest.mark.parametrize("content, expect", [
    (VALID + "\n" + VALID.replace('"1/20"', '"2/20"')[:70] + "\n", "line 2 is not JSON"),     # cut mid-write
    (VALID + "\n[1, 2]\n", "line 2 is not a JSON object"),
    (VALID + "\n" + VALID.replace('"1/20"', '12'), "line 2: global_step/max_steps is '12', not STEP/MAX_STEPS"),
    (VALID + "\n" + VALID.replace('"1/20"', '"step 2"'), "is 'step 2', not STEP/MAX_STEPS"),
])
def test_a_malformed_line_is_one_line_and_exit_2(tmp_path, capsys, content, expect):
    from rlwatch.replay.formats import detect

    path = tmp_path / "logging.jsonl"
    path.write_text(content)
    assert detect(content, str(path)) == "ms-swift"
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expect in err, err
    with pytest.raises(ReplayInputError):
        load(path)


def test_other_json_lines_are_read_as_before(tmp_path):
    """A flat ``{"step": N, ...}`` log is still verl's JSONL format; ms-swift's format is chosen only for
    its step field, and forcing it on another log finds no step."""
    flat = tmp_path / "flat.jsonl"
    flat.write_text("".join(json.dumps({"step": s, "reward": 0.1 * s}) + "\n" for s in range(1, 6)))
    run = load(flat)
    assert run.fmt == "verl-jsonl" and run.steps == [1, 2, 3, 4, 5]
    swift = tmp_path / "logging.jsonl"
    swift.write_text(VALID + "\n" + VALID.replace('"1/20"', '"2/20"') + "\n")
    assert load(swift).fmt == "ms-swift" and load(swift).steps == [1, 2]
    with pytest.raises(ReplayInputError, match="no logged step found"):
        load(flat, fmt="ms-swift")
