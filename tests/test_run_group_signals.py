"""`rlwatch run` and the signals that end a run, with real processes: a signal sent to the whole
process group (`timeout`, Slurm, `kill -INT -PGID`) reaches the trainer once; a run stopped by a
signal unregisters from file_sd at once (no RLWatchExporterDown a minute later)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_run_signals import TRAINER, _alive, _env, _stop, _wait_file

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")

# A trainer that exports (registering in $RLWATCH_SD_DIR) and has no handler of its own: a signal
# ends it by the signal's default action, without atexit or Watch.close().
EXPORTING = """
import os, sys, time
import rlwatch
from tests.conftest import make_step
watch = rlwatch.Watch(run="stopped", port=0, store=None, alerts=False)
watch.observe(0, **make_step())
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def _default_dispositions() -> None:
    """The signals this test sends at their default action in `rlwatch run` and its command, whatever the test
    runner inherited: under `nohup` SIGHUP is ignored, and a command that ignores it never ends by it."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_DFL)


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.json"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1])
def test_a_run_stopped_by_a_signal_removes_its_file_sd_entry(tmp_path, signum):
    """SIGTERM (or SIGHUP, SIGUSR1) to `rlwatch run`: the trainer ends by it (128 + N) and its file_sd
    entry is gone when `rlwatch run` returns; the entry of a process still alive is left."""
    sd_dir = tmp_path / "targets"
    sd_dir.mkdir()
    script = tmp_path / "trainer.py"
    script.write_text(EXPORTING)
    env = dict(_env(), RLWATCH_SD_DIR=str(sd_dir))
    bystander = subprocess.Popen([sys.executable, "-c", EXPORTING, str(tmp_path / "bystander")], cwd=ROOT, env=env)
    proc = subprocess.Popen([sys.executable, "-m", "rlwatch", "run", "--store", "none", "--", sys.executable,
                             str(script), str(tmp_path / "ready")], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_default_dispositions)
    trainer = 0
    try:
        _wait_file(tmp_path / "bystander", bystander)
        trainer = _wait_file(tmp_path / "ready", proc)
        assert len(_entries(sd_dir)) == 2
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=30)
        left = _entries(sd_dir)
    finally:
        _stop(proc, trainer)
        _stop(bystander)
    assert proc.returncode == 128 + signum, err
    assert len(left) == 1 and f"-{bystander.pid}-" in left[0], (left, err)      # the live one stays
    assert not _alive(trainer)


@pytest.mark.slow
def test_timeout_signalling_the_group_reaches_the_trainer_once(tmp_path):
    """`timeout -s INT 6 rlwatch run -- python trainer.py`: timeout signals rlwatch run, then its
    whole process group; the trainer's handler runs once and its 1.5 s checkpoint completes."""
    if shutil.which("timeout") is None:
        pytest.skip("coreutils timeout not installed")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    start = time.monotonic()
    proc = subprocess.Popen(["timeout", "-s", "INT", "6", sys.executable, "-m", "rlwatch", "run", "--store", "none",
                             "--", sys.executable, str(script), str(tmp_path / "ready"), str(tmp_path / "ckpt")],
                            env=_env(), cwd=ROOT, stderr=subprocess.PIPE, start_new_session=True)
    trainer = 0
    try:
        trainer = _wait_file(tmp_path / "ready", proc)
        assert time.monotonic() - start < 5.5, "the trainer started too late for the test"
        _, err = proc.communicate(timeout=30)
    finally:
        _stop(proc, trainer)
    assert (tmp_path / "ckpt").read_text() == "1", err       # one handler call, checkpoint written
    assert proc.returncode == 124, err                          # timeout's own status when it timed out
    assert not _alive(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sent_to_the_process_group_reaches_the_trainer_once(tmp_path, signum):
    """`kill -TERM -PGID` (a scheduler stopping the job's group): the trainer's handler runs once, its
    checkpoint completes, rlwatch run exits 128 + N."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, "-m", "rlwatch", "run", "--store", "none", "--", sys.executable,
                             str(script), str(tmp_path / "ready"), str(tmp_path / "ckpt")],
                            env=_env(), cwd=ROOT, stderr=subprocess.PIPE, start_new_session=True)
    trainer = 0
    try:
        trainer = _wait_file(tmp_path / "ready", proc)
        os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=30)
    finally:
        _stop(proc, trainer)
    assert (tmp_path / "ckpt").read_text() == "1", err
    assert proc.returncode == 128 + signum, err
    assert not _alive(trainer)
