"""Shared by the OpenRLHF tests (tests/test_openrlhf_*.py). Imported first: it puts the 0.11.0 source
(in the 0.11.0 subprocess) and the test-only import stubs on the path, and skips the importing module
without openrlhf (fails it under RLWATCH_REQUIRE_FRAMEWORKS=1). Then the small training loop's set-up and
the values rlwatch should see, built from OpenRLHF's objects independently."""

from __future__ import annotations

import importlib.util
import os
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .conftest import REQUIRE_FRAMEWORKS, ROOT, need_module

# Set in the 0.11.0 subprocess: an older openrlhf source tree to import instead of the installed one.
OLD_SOURCE = os.environ.get("RLWATCH_OPENRLHF_SOURCE")
if OLD_SOURCE:
    sys.path.insert(0, OLD_SOURCE)
if not REQUIRE_FRAMEWORKS:
    pytest.importorskip("openrlhf")
need_module("openrlhf")
ray = need_module("ray")

STUBS = str(ROOT / "tests" / "openrlhf_stubs")
if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("vllm") is None:
    sys.path.insert(0, STUBS)           # test-only import stubs (tests/openrlhf_stubs/README.md)

from rlwatch import Watch  # noqa: E402
from rlwatch.integrations._instrumentor import installed_version  # noqa: E402

from . import _openrlhf_mini as mini  # noqa: E402

VERSION = installed_version("openrlhf")
OLD_API = VERSION is not None and VERSION.startswith("0.11.0")
N = 4                                                   # rollout.n_samples_per_prompt
ARGV = ["--rollout.n_samples_per_prompt", str(N), "--rollout.batch_size", "2", "--train.batch_size", "8",
        "--rollout.micro_batch_size", "4", "--rollout.max_new_tokens", "6", "--data.max_len", "24",
        "--algo.advantage.estimator", "group_norm", "--ckpt.save_steps", "2", "--rollout.temperature", "0.9"]
ARGV_IS = ["--algo.advantage.is_correction_enable"] if OLD_API else ["--algo.advantage.is_correction_level", "token"]
versions = pytest.mark.openrlhf_versions


# --- the training loop's set-up ------------------------------------------------------------------

def _pythonpath() -> str:
    paths = [p for p in (OLD_SOURCE, STUBS if STUBS in sys.path else None, str(ROOT)) if p]
    return os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def minimal_args(*argv: str):
    """OpenRLHF's arguments for a run that is never started (only the parsed namespace is used)."""
    return mini.parse_args(["--actor.model_name_or_path", "x", "--actor.num_gpus_per_node", "1",
                            "--algo.advantage.estimator", "reinforce", *argv])


def build(tmp_path: Path, argv: list[str] = (), agent: bool = False, seed: int = 0, **kwargs) -> SimpleNamespace:
    torch.manual_seed(seed)
    return mini.build(tmp_path, [*ARGV, *argv], agent=agent, engine_seed=seed, **kwargs)


# --- the values rlwatch should see, built from OpenRLHF's objects independently ---------------------

def expected_fields(run: SimpleNamespace, samples: list, experiences: list, version: tuple[int, int] | None,
                    trainer_version: int | None) -> dict:
    """What one training step means, read off OpenRLHF's own Experiences: response tokens (action
    mask), pi_old (action_log_probs), vLLM's log-probs, rewards, groups of n in rollout order
    (Experience.index), the dataset's datasource column, the truncation flag."""
    width = max(e.action_mask.shape[1] for e in experiences)

    def cat(name):
        return torch.cat([torch.nn.functional.pad(getattr(e, name), (0, width - getattr(e, name).shape[1]))
                          for e in experiences])

    index = [i for e in experiences for i in e.index]
    dataset = run.generator.prompts_dataloader.dataset
    source = dict(zip(dataset.prompts, dataset.datasources))
    fields = dict(mask=cat("action_mask").bool(), trainer_logp=cat("action_log_probs").float(),
                  rewards=torch.cat([e.rewards for e in experiences]).double(),
                  group_ids=torch.tensor(index) // N, env=[source[samples[i].prompts[0]] for i in index],
                  truncated=torch.cat([e.truncated for e in experiences]).bool(),
                  temperature=run.args.rollout.temperature, top_p=run.args.rollout.top_p)
    if experiences[0].rollout_log_probs is not None:
        fields.update(sampler_logp=cat("rollout_log_probs").float(), logprobs_mode="processed_logprobs")
    if version is not None:
        fields.update(seq_version=torch.tensor([list(version)] * len(index)), trainer_version=trainer_version)
    return fields


def scalars(watch: Watch, step: int) -> dict[str, float]:
    watch.flush()
    with sqlite3.connect(watch.store_path) as db:
        return dict(db.execute("SELECT name, value FROM scalars WHERE step = ?", (step,)).fetchall())


def steps(watch: Watch) -> list[int]:
    watch.flush()
    with sqlite3.connect(watch.store_path) as db:
        return [row[0] for row in db.execute("SELECT step FROM steps ORDER BY step")]


def checkpoints(watch: Watch) -> list[tuple[int, str]]:
    watch.flush()
    with sqlite3.connect(watch.store_path) as db:
        return db.execute("SELECT step, path FROM checkpoints ORDER BY step").fetchall()
