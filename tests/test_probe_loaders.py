"""`rlwatch postmortem --probe` on what a newcomer has: the demo's run directory (its GRU checkpoints
and the rollouts file the demo writes next to its store), a transformers checkpoint (a tiny model
made here, no download), and a kind rlwatch has no loader for, through `--probe-loader module:function`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlwatch
from rlwatch.postmortem.probe import ROLLOUTS_FILE, save_rollouts

from tests.conftest import ROOT
from tests.test_postmortem import tiny_hf_checkpoint


def postmortem(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def store_with_checkpoints(tmp_path: Path, checkpoints: list[Path]) -> Path:
    store = tmp_path / "run.db"
    with rlwatch.Watch(run="probed", port=None, store=str(store), alerts=False) as watch:
        for step, path in enumerate(checkpoints):
            watch.log_scalars(step, {"reward": 0.5})
            watch.record_checkpoint(step, str(path))
    return store


@pytest.mark.slow
def test_probe_on_the_demos_own_run_directory(tmp_path, capsys):
    from rlwatch.demo.app import run_demo

    doc = run_demo(steps=10, port=None, live=False, out=str(tmp_path / "demo"))
    run_dir = Path(doc["demo"]["directory"])
    assert (run_dir / ROLLOUTS_FILE).exists()                   # the demo keeps the probe's rollouts
    capsys.readouterr()
    result = postmortem(str(run_dir), "--probe", "--json", cwd=tmp_path)  # `--probe` alone finds them
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout)["probe"]
    assert [r["step"] for r in rows] == [4, 9] and [r["error"] for r in rows] == [None, None]
    assert all(-10 < r["mean_logp"] < 0 for r in rows) and rows[0]["kl_to_next"] > 0


@pytest.mark.frameworks          # a tiny transformers model, made here
def test_probe_on_a_transformers_checkpoint(tmp_path):
    paths = []
    for step, scale in enumerate((0.0, 0.05, 0.5)):
        tiny_hf_checkpoint(tmp_path / f"checkpoint-{step}", seed=step, scale=scale)
        paths.append(tmp_path / f"checkpoint-{step}")
    store = store_with_checkpoints(tmp_path, paths)
    ids = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(0))
    response = torch.zeros(4, 12, dtype=torch.long)
    response[:, 6:] = 1
    save_rollouts(tmp_path / ROLLOUTS_FILE, ids, torch.ones_like(ids), response)
    result = postmortem(str(store), "--probe", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Checkpoint probe" in result.stdout and "ERROR" not in result.stdout, result.stdout[-2000:]
    rows = [line for line in result.stdout.splitlines() if "mean log p" in line]
    assert len(rows) == 3 and all("mean log p -" in r for r in rows)


LOADER = '''
from pathlib import Path

import torch
from safetensors.torch import load_file


def load(directory: Path, config: dict):
    if config.get("kind") != "bigram":
        return None
    table = load_file(str(directory / "weights.safetensors"))["table"]     # [V, V] next-token logits
    return lambda ids, attention_mask: table[ids]
'''


def test_probe_with_a_loader_of_your_own(tmp_path):
    from safetensors.torch import save_file

    paths = []
    for step in range(2):
        path = tmp_path / f"ckpt-{step}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"kind": "bigram"}))
        save_file({"table": torch.randn(8, 8, generator=torch.Generator().manual_seed(step))},
                  str(path / "weights.safetensors"))
        paths.append(path)
    store = store_with_checkpoints(tmp_path, paths)
    ids = torch.randint(0, 8, (3, 6), generator=torch.Generator().manual_seed(1))
    save_rollouts(tmp_path / ROLLOUTS_FILE, ids, torch.ones_like(ids), torch.ones_like(ids))
    (tmp_path / "bigram_loader.py").write_text(LOADER)
    without = postmortem(str(store), "--probe", "--json", cwd=tmp_path)
    assert all("no loader for this checkpoint" in r["error"] and "--probe-loader" in r["error"]
               for r in json.loads(without.stdout)["probe"])
    result = postmortem(str(store), "--probe", "--probe-loader", "bigram_loader:load", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout)["probe"]
    assert [r["error"] for r in rows] == [None, None] and rows[0]["kl_to_next"] > 0
    bad = postmortem(str(store), "--probe", "--probe-loader", "no_such_module:load", cwd=tmp_path)
    assert bad.returncode == 1 and "--probe-loader 'no_such_module:load'" in bad.stderr
