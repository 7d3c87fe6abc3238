"""Prometheus file_sd registration (rlwatch.discovery): one file per Watch, readable by a Prometheus
running as another user, and the entry of a killed process removed once it has had time to page."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlwatch import Watch
from rlwatch.discovery import STALE_GRACE_S, Registration, clean_stale

from .conftest import ROOT


def entries(directory: Path) -> dict[str, str]:
    """{file name: run label} of the target files in ``directory``."""
    return {p.name: json.loads(p.read_text())[0]["labels"]["run"] for p in directory.glob("*.json")}


def test_runs_whose_names_collide_in_a_file_name_keep_their_own_registration(tmp_path):
    first = Registration(str(tmp_path), "exp 1", "127.0.0.1", 9401)
    second = Registration(str(tmp_path), "exp_1", "127.0.0.1", 9402)
    assert sorted(entries(tmp_path).values()) == ["exp 1", "exp_1"]
    first.remove()
    assert list(entries(tmp_path).values()) == ["exp_1"]
    second.remove()
    with Watch(run="same", port=0, store=None, sd_dir=str(tmp_path)) as one:
        with Watch(run="same", port=0, store=None, sd_dir=str(tmp_path)) as two:
            targets = sorted(json.loads(p.read_text())[0]["targets"][0] for p in tmp_path.glob("*.json"))
            assert targets == sorted([f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"])
        assert [json.loads(p.read_text())[0]["targets"][0] for p in tmp_path.glob("*.json")] == \
            [f"127.0.0.1:{one.port}"]                                   # closing two left one's entry
    assert not list(tmp_path.glob("*.json"))


def test_entries_are_readable_as_far_as_their_directory_is(tmp_path):
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir(mode=0o755)
    private.mkdir(mode=0o700)
    os.chmod(shared, 0o755)                                             # whatever the umask
    os.chmod(private, 0o700)
    readable = Registration(str(shared), "run", "127.0.0.1", 9401)
    kept = Registration(str(private), "run", "127.0.0.1", 9401)
    assert os.stat(readable.path).st_mode & 0o777 == 0o644            # Prometheus as another user reads it
    assert os.stat(kept.path).st_mode & 0o777 == 0o600


KILLED = """
import sys, time
from rlwatch import Watch
watch = Watch(run="killed", port=0, store=None, sd_dir=sys.argv[1])
print("registered", flush=True)
time.sleep(300)
"""


def test_a_killed_process_entry_stays_long_enough_to_page_then_goes(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "registered"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    (dead,) = entries(tmp_path)
    # The next registration sees it dead: it stays (Prometheus finds it down, RLWatchExporterDown pages)...
    live = Registration(str(tmp_path), "live", "127.0.0.1", 9401)
    assert set(entries(tmp_path)) == {dead, Path(live.path).name}
    # ...until STALE_GRACE_S after it was first seen dead; a live process's entry is never removed.
    marker = tmp_path / f".{dead}.dead"
    past = time.time() - STALE_GRACE_S - 1
    os.utime(marker, (past, past))
    assert clean_stale(str(tmp_path)) == [str(tmp_path / dead)]
    assert set(entries(tmp_path)) == {Path(live.path).name} and not marker.exists()
    live.remove()
    assert not list(tmp_path.iterdir())
