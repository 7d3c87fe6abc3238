"""The runnable examples, as a user runs them: paced by default, `--pace 0` for tests, no store
with `--store none`, and the TRL example shows the headline signals on CPU (its rollout_func
reports the sampler's log-probs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlwatch.postmortem.analysis import MISMATCH_ALERTS

from tests.conftest import ROOT, need_module


def run_example(name: str, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                            cwd=cwd, env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_custom_loop_store_none_and_pace(tmp_path):
    result = run_example("custom_loop.py", "--steps", "2", "--pace", "0", "--store", "none", "--port", "0",
                         cwd=tmp_path)
    assert "run store none; 2 steps, at least 0 s each" in result.stdout
    assert not list(tmp_path.iterdir())                          # no rlwatch-runs/, no files named none*
    helptext = run_example("custom_loop.py", "--help", cwd=tmp_path).stdout
    assert "--pace" in helptext and "default 0.5" in helptext


@pytest.mark.slow
def test_custom_loop_prints_each_resolution_like_its_firing(tmp_path):
    """With the lag at 8, RLWatchKLSpike fires, resolves and fires again: the console shows the
    RESOLVED line between the two FIRING lines, as the run store has it (no logging set up by the script)."""
    result = run_example("custom_loop.py", "--steps", "70", "--lag", "8", "--pace", "0", "--store",
                         str(tmp_path / "run.db"), "--port", "0", cwd=tmp_path)
    lines = [x for x in result.stderr.splitlines() if x.startswith("rlwatch alert ")]
    spike = [x.split()[2] for x in lines if " RLWatchKLSpike " in x]
    assert spike[:3] == ["FIRING", "RESOLVED", "FIRING"], lines
    from rlwatch.postmortem import load

    stored = load(str(tmp_path / "run.db")).alerts
    assert sum(a["state"] == "resolved" for a in stored) == sum(" RESOLVED " in x for x in lines) > 0


@pytest.mark.slow
def test_trl_example_shows_the_headline_signals_on_cpu(tmp_path):
    need_module("trl")
    result = run_example("trl_grpo.py", "--steps", "2", "--pace", "0", "--port", "0", "--output-dir",
                         str(tmp_path / "run"), cwd=tmp_path)
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("rlwatch: headline signals")]
    values = dict(item.split("=") for item in line.split(": ", 2)[2].split(", "))
    assert {"kl_k3", "abs_log_ratio_p99", "is_ess", "is_tis_truncated_frac", "version_lag_max",
            "zero_variance_all_fail_frac", "alerts_firing"} <= set(values)
    assert float(values["kl_k3"]) < 1e-3 and float(values["is_ess"]) > 0.99      # a sampler in sync
    assert (tmp_path / "run" / "out" / "rlwatch.db").exists()


def postmortem(path: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", str(path), *args],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow        # about 10-20 s: in `make test`, out of the fast loop (`make check`)
def test_custom_loop_post_mortem_puts_its_mismatch_on_the_lag_and_names_it_only_if_the_run_suffered(tmp_path):
    """The example's sampler runs 2 updates behind on the same numerics: staleness explains the
    mismatch, never numeric noise; it is the run's cause only if the run degraded or an alert on the
    mismatch fired, otherwise the report says it stayed below alert levels."""
    run_example("custom_loop.py", "--steps", "12", "--pace", "0", "--store", str(tmp_path / "run.db"), "--port", "0",
                cwd=tmp_path)
    doc = json.loads(postmortem(tmp_path / "run.db", "--json"))
    assert doc["mismatch_diagnosis"] == "stale_weights" and "numeric_noise" not in postmortem(tmp_path / "run.db")
    suffered = doc["collapse_step"] is not None or {a["name"] for a in doc["alerts"]} & MISMATCH_ALERTS
    if suffered:
        assert doc["cause"] == "stale_weights" and doc["mismatch_explanation"] is None, doc["alerts"]
    else:
        assert doc["cause"] == "no cause found", doc["alerts"]
        assert doc["mismatch_explanation"] == "mismatch explained by stale_weights, below alert levels"


@pytest.mark.slow
def test_trl_example_in_sync_post_mortem_names_no_cause(tmp_path):
    need_module("trl")
    run_example("trl_grpo.py", "--steps", "6", "--pace", "0", "--port", "0", "--output-dir", str(tmp_path / "run"),
                cwd=tmp_path)
    text = postmortem(tmp_path / "run" / "out")
    assert "cause: numeric_noise" not in text and "cause: no cause found" in text, text[:2000]


@pytest.mark.slow
def test_trl_example_with_a_stale_sampler_shows_the_samplers_lag(tmp_path):
    """The rollout_func's sampler syncs its weights every 4 steps and says which weights sampled
    (``policy_version``): the version lag is the sampler's own, 0 1 2 3 0 1 2 3, in TRL's logs and
    in the store (TRL alone would show 0 at every step: each batch is used once)."""
    need_module("trl")
    result = run_example("trl_grpo.py", "--steps", "8", "--stale-sampler", "4", "--num-iterations", "1", "--pace",
                         "0", "--port", "0", "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("rlwatch: max version lag per step")]
    assert line.split(": ")[-1] == "0 1 2 3 0 1 2 3", line
    from rlwatch.runs.store import StoreReader

    with StoreReader(str(tmp_path / "run" / "out" / "rlwatch.db")) as store:
        run = store.runs()[-1]
        lags = [v for _, v in store.series(run, "version_lag_max")]
        k3 = [v for _, v in store.series(run, "mismatch_kl_k3")]
    assert lags == [0, 1, 2, 3, 0, 1, 2, 3], lags
    # Just after a weight sync the sampler is the trainer (round-off); a stale sampler's k3 is above it.
    assert max(k3[0], k3[4]) < 1e-9 and min(k3[1:4] + k3[5:]) > 1e-5, k3
