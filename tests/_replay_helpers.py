"""Logged runs for the replay tests, each written by the real package that writes that format (or,
where the format is an export made by a UI, in its documented layout)."""

from __future__ import annotations

import contextlib
import csv
import math
import os
import subprocess
from pathlib import Path

from .conftest import ROOT

#: The collapsed synthetic run: the reward climbs to 0.8 by step 30 and falls to 0.05 at DROP.
DROP = 40
STEPS = 60


def collapsed_rows(reward_key: str = "reward", steps: int = STEPS, every: int = 1) -> list[tuple[int, dict]]:
    """``[(step, {key: value})]``: a reward that rises, holds and collapses at :data:`DROP`, an entropy
    and a loss beside it."""
    out = []
    for step in range(every, steps + 1, every):
        reward = 0.1 + 0.7 * min(step, 30) / 30 if step < DROP else 0.05
        out.append((step, {reward_key: reward, "entropy": 0.6 + 0.01 * (step % 3), "loss": 0.02 * (step % 5)}))
    return out


def write_trl(path: Path, rows: list[tuple[int, dict]]) -> Path:
    """transformers' own ``TrainerState.save_to_json`` with ``log_history`` (and its final summary entry)."""
    from transformers import TrainerState

    history = [{**values, "step": step, "epoch": step / len(rows)} for step, values in rows]
    history.append({"step": rows[-1][0], "train_runtime": 12.5, "train_loss": 0.3, "total_flos": 0.0})
    TrainerState(global_step=rows[-1][0], max_steps=rows[-1][0], log_history=history).save_to_json(str(path))
    return path


def write_verl_console(path: Path, rows: list[tuple[int, dict]], ray_prefix: str = "") -> Path:
    """verl's console logger (``LocalLogger``, what ``Tracking(default_backend="console")`` prints), the
    values numpy scalars as verl's metric reductions return them; ``ray_prefix`` put before each line
    as Ray's log forwarding does for a line printed in an actor (``(TaskRunner pid=4242) ``)."""
    import io

    import numpy as np
    from verl.utils.logger.aggregate_logger import LocalLogger

    logger = LocalLogger(print_to_console=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print("Training Progress:   0%|          | 0/60")      # a line of another kind
        for step, values in rows:
            logger.log({k: np.float64(v) for k, v in values.items()}, step=step)
    path.write_text("".join(ray_prefix + line + "\n" for line in printed.getvalue().splitlines()))
    return path


def write_verl_jsonl(path: Path, rows: list[tuple[int, dict]]) -> Path:
    """verl's ``file`` logger backend (``FileLogger``, ``VERL_FILE_LOGGER_PATH``)."""
    from verl.utils.tracking import FileLogger

    saved = os.environ.get("VERL_FILE_LOGGER_PATH")
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            logger = FileLogger("project", "experiment")
        for step, values in rows:
            logger.log(values, step=step)
        logger.finish()
    finally:
        if saved is None:
            os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        else:
            os.environ["VERL_FILE_LOGGER_PATH"] = saved
    return path


def write_wandb_csv(path: Path, rows: list[tuple[int, dict]], run: str = "grpo-qwen-0.5b") -> Path:
    """W&B's panel export: ``Step``, then ``<run> - <key>`` with its ``__MIN`` / ``__MAX`` columns, the
    keys as TRL's W&B callback logs them (``train/`` prefix)."""
    keys = sorted({k for _, values in rows for k in values})
    header = ["Step"] + [f"{run} - train/{k}{suffix}" for k in keys for suffix in ("", "__MIN", "__MAX")]
    with open(path, "w", newline="") as out:
        writer = csv.writer(out, quoting=csv.QUOTE_ALL)
        writer.writerow(header)
        for step, values in rows:
            writer.writerow([step] + [values.get(k, "") for k in keys for _ in range(3)])
    return path


def write_tensorboard_csvs(directory: Path, rows: list[tuple[int, dict]]) -> list[Path]:
    """OpenRLHF's ``TensorboardLogger`` writes ``train/<key>`` scalars with torch's ``SummaryWriter``;
    TensorBoard's scalar export of each tag (``Wall time,Step,Value``), read back from the event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    events = directory / "tb"
    writer = SummaryWriter(log_dir=str(events))
    for step, values in rows:
        for key, value in values.items():
            writer.add_scalar(f"train/{key}", value, step)
    writer.close()
    acc = EventAccumulator(str(events))
    acc.Reload()
    out = []
    for tag in acc.Tags()["scalars"]:
        path = directory / f"run-tb-tag-{tag.replace('/', '_')}.csv"
        with open(path, "w", newline="") as f:
            writer_csv = csv.writer(f)
            writer_csv.writerow(["Wall time", "Step", "Value"])
            for event in acc.Scalars(tag):
                writer_csv.writerow([event.wall_time, event.step, event.value])
        out.append(path)
    return out


OPENRLHF_PYTHON = ROOT / ".venv-openrlhf" / "bin" / "python"

#: OpenRLHF's own logger and the message of ``PPOTrainer.fit`` (openrlhf/trainer/ppo_trainer.py).
_OPENRLHF_SCRIPT = """
import json, sys
import numpy as np
from openrlhf.utils.logging_utils import init_logger
logger = init_logger("openrlhf.trainer.ppo_trainer")
for global_step, status in json.load(open(sys.argv[1])):
    status = {k: (np.float64(v) if k == "reward" else v) for k, v in status.items()}
    log_status = {k: v for k, v in status.items() if k not in ["generated_samples"]}
    logger.info(f"\\u2728 Global step {global_step}: {log_status}")
    if global_step % 20 == 0:
        time_str, logs = "0:00:12", {"eval_gsm8k_pass1": status["reward"], "eval_num_samples": 64.0}
        logger.info(f"\\u2728 Evaluation completed in {time_str}, global_step {global_step}, eval_metrics: {logs}")
"""


def openrlhf_python() -> Path | None:
    """OpenRLHF's environment's interpreter, where it is set up."""
    return OPENRLHF_PYTHON if OPENRLHF_PYTHON.exists() else None


def write_openrlhf_log(path: Path, rows: list[tuple[int, dict]], python: Path) -> Path:
    """OpenRLHF's console log, written by its own logger in its own environment."""
    import json

    spec = path.with_suffix(".rows.json")
    spec.write_text(json.dumps([[step, values] for step, values in rows]))
    done = subprocess.run([str(python), "-c", _OPENRLHF_SCRIPT, str(spec)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    path.write_text(done.stdout + done.stderr)
    return path


def finite(values: dict) -> dict:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


__all__ = ["DROP", "STEPS", "collapsed_rows", "finite", "openrlhf_python", "write_openrlhf_log", "write_trl",
           "write_tensorboard_csvs", "write_verl_console", "write_verl_jsonl", "write_wandb_csv"]
