"""`rlwatch run` and signals, with real processes: Ctrl-C typed on a real pseudo-terminal reaches the
trainer once and its checkpoint completes; SIGTERM to `rlwatch run` is passed on and awaited (no
orphan); a second Ctrl-C stops the trainer at once; a command ended by signal N exits 128 + N."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminals and /proc: Linux")

# A trainer that saves a 1.5 s checkpoint when told to stop (SIGINT or SIGTERM), counting the stop
# signals it received meanwhile, then ends by the first of them (no traceback of its own).
TRAINER = """
import os, signal, sys, time
got = []
def on_stop(signum, frame):
    got.append(signum)
signal.signal(signal.SIGINT, on_stop)
signal.signal(signal.SIGTERM, on_stop)
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while not got:
    time.sleep(0.01)
time.sleep(1.5)                                   # the checkpoint
open(sys.argv[2], "w").write(str(len(got)))
signal.signal(got[0], signal.SIG_DFL)
os.kill(os.getpid(), got[0])
"""
# A trainer that ignores Ctrl-C.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                RLWATCH_FRAMEWORKS="none")


def _rlwatch_run(script: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlwatch", "run", "--store", "none", "--",
                             sys.executable, str(script), *args], env=_env(), **popen)


def _on_terminal(script: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """`rlwatch run` as a shell's foreground job on a new pseudo-terminal; (process, terminal fd)."""
    import fcntl
    import termios

    master, slave = os.openpty()
    proc = _rlwatch_run(script, *args, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    return proc, master


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"rlwatch run ended early: {proc.returncode}"
        assert time.monotonic() < deadline, "the trainer did not start"
        time.sleep(0.02)
    return int(path.read_text())


def _read_all(master: int, proc: subprocess.Popen, timeout: float) -> str:
    """What the terminal showed until ``proc`` ended (at most ``timeout`` s)."""
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:                 # EIO: every process holding the terminal ended
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=5)
    return out.decode(errors="replace")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stop(proc: subprocess.Popen, *pids: int) -> None:
    for pid in pids:
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_ctrl_c_on_the_terminal_lets_the_trainer_finish_its_checkpoint(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc, master = _on_terminal(script, str(tmp_path / "ready"), str(tmp_path / "ckpt"))
    trainer = 0
    try:
        trainer = _wait_file(tmp_path / "ready", proc)
        os.write(master, b"\x03")                               # Ctrl-C, typed
        shown = _read_all(master, proc, timeout=30)
    finally:
        _stop(proc, trainer)
        os.close(master)
    assert (tmp_path / "ckpt").read_text() == "1", shown         # saved, and interrupted only once
    assert proc.returncode == 130, shown                         # 128 + SIGINT
    assert "Traceback" not in shown and "KeyboardInterrupt" not in shown, shown
    assert not _alive(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sent_to_rlwatch_run_is_passed_on_and_awaited(tmp_path, signum):
    """`kill` (or a scheduler) stopping `rlwatch run`: the trainer gets the signal once, saves, and
    `rlwatch run` returns only once it ended: no orphan left running."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = _rlwatch_run(script, str(tmp_path / "ready"), str(tmp_path / "ckpt"), stderr=subprocess.PIPE,
                        start_new_session=True)
    trainer = 0
    try:
        trainer = _wait_file(tmp_path / "ready", proc)
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=30)
        orphan = _alive(trainer)
    finally:
        _stop(proc, trainer)
    assert not orphan
    assert (tmp_path / "ckpt").read_text() == "1", err
    assert proc.returncode == 128 + signum, err
    assert b"Traceback" not in err, err


@pytest.mark.slow
def test_a_second_ctrl_c_stops_the_trainer_at_once(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    proc, master = _on_terminal(script, str(tmp_path / "ready"))
    trainer = 0
    try:
        trainer = _wait_file(tmp_path / "ready", proc)
        os.write(master, b"\x03")
        time.sleep(0.5)
        still_running = proc.poll() is None and _alive(trainer)
        os.write(master, b"\x03")
        start = time.monotonic()
        shown = _read_all(master, proc, timeout=20)
        took = time.monotonic() - start
    finally:
        _stop(proc, trainer)
        os.close(master)
    assert still_running, shown
    assert "Ctrl-C again stops it at once" in shown, shown
    assert proc.returncode == 128 + signal.SIGKILL and took < 5, shown
    assert "Traceback" not in shown, shown


def test_rlwatch_run_dying_takes_the_trainer_with_it(tmp_path):
    """Even SIGKILL to `rlwatch run` (it cannot pass that on) stops the trainer: it gets SIGTERM."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = _rlwatch_run(script, str(tmp_path / "ready"), str(tmp_path / "ckpt"), stderr=subprocess.DEVNULL,
                        start_new_session=True)
    trainer = 0
    try:
        trainer = _wait_file(tmp_path / "ready", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive(trainer) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = not _alive(trainer)
    finally:
        _stop(proc, trainer)
    assert gone
    assert (tmp_path / "ckpt").read_text() == "1"              # told by SIGTERM: it saved first


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGKILL])
def test_a_command_ended_by_a_signal_exits_128_plus_its_number(tmp_path, signum):
    result = subprocess.run([sys.executable, "-m", "rlwatch", "run", "--quiet", "--", sys.executable, "-c",
                             f"import os; os.kill(os.getpid(), {int(signum)})"], env=_env(), capture_output=True,
                            timeout=60)
    assert result.returncode == 128 + signum, result.stderr
    assert b"Traceback" not in result.stderr
