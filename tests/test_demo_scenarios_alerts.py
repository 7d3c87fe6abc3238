"""The healthy demo does not warn of an entropy collapse: the toy's entropy falls as it learns its one
right answer per prompt, which the demo's own threshold allows for (a run of yours keeps the shipped
one, which this same trajectory crosses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow


def test_the_healthy_demo_fires_no_entropy_collapse_and_the_shipped_threshold_would(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "rlwatch", "demo", "--scenario", "healthy", "--no-live", "--port",
                             str(free_port()), "--out", "demo"], capture_output=True, text=True, timeout=600,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = (tmp_path / "demo").glob("healthy-*")
    doc = json.loads((run_dir / "report" / "postmortem.json").read_text())
    fired = {a["name"] for a in doc["alerts"] if a.get("state", "firing") == "firing"}
    assert "RLWatchEntropyCollapse" not in fired, fired

    from rlwatch.alerts.domains.distribution import PARAMS
    from rlwatch.postmortem import load

    entropy = [v for _, v in load(str(run_dir / "run.db")).series("entropy_mean")]
    shipped = PARAMS["entropy_collapse_ratio"].default
    assert min(entropy[20:]) < shipped * max(entropy), "the shipped threshold would not fire: nothing shown"
