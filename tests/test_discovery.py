"""Prometheus file_sd registration (rlwatch.runs.discovery): one file per Watch, readable by a Prometheus
running as another user, and the entry of a killed process removed once it has had time to page."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlwatch import Watch
from rlwatch.runs.discovery import STALE_GRACE_S, Registration, clean_stale

from tests.conftest import ROOT


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


FORKED = """
import json, os, sys
from rlwatch import Watch
with Watch(run="forked", port=0, store=None, alerts=False, sd_dir=sys.argv[1]) as watch:
    pid = os.fork()
    if pid == 0:
        sys.exit(0)                           # the child leaves the with block: close() runs in it
    os.waitpid(pid, 0)
    print(json.dumps(sorted(n for n in os.listdir(sys.argv[1]) if n.endswith(".json"))), flush=True)
"""


def test_a_forked_child_closing_the_watch_leaves_the_parents_entry(tmp_path):
    out = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(json.loads(out.stdout)) == 1, out.stdout             # Prometheus still scrapes the parent
    assert not list(tmp_path.glob("*.json"))                          # which removed it when it closed


CONTAINED = """
import sys, time
from rlwatch import Watch
watch = Watch(run="contained", port=0, store=None, alerts=False, sd_dir=sys.argv[1])
print("registered", flush=True)
time.sleep(300)
"""


def test_an_entry_of_another_pid_namespace_is_judged_by_its_endpoint(tmp_path):
    """A container that shares this host's name (and the file_sd directory) but not its PIDs: its
    live exporter's entry stays however long the grace; once its endpoint refuses, it goes."""
    import shutil

    unshare = shutil.which("unshare")
    namespaced = [unshare, "--user", "--map-root-user", "--pid", "--mount-proc", "--kill-child"] if unshare else []
    if not unshare or subprocess.run([*namespaced, "true"], capture_output=True).returncode != 0:
        pytest.skip("no unshare, or new PID namespaces are not allowed here")
    proc = subprocess.Popen([*namespaced, sys.executable, "-c", CONTAINED, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "registered"
        (entry,) = entries(tmp_path)
        assert clean_stale(str(tmp_path), grace=0) == []               # its PID means nothing here: alive
        assert list(entries(tmp_path)) == [entry]
    finally:
        os.kill(proc.pid, signal.SIGKILL)                            # unshare takes its child along
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while clean_stale(str(tmp_path), grace=0) != [str(tmp_path / entry)] and time.monotonic() < deadline:
        time.sleep(0.1)                                              # refused once the child is gone
    assert not entries(tmp_path)


def test_one_run_instance_given_to_two_live_processes_is_made_unique_warned_and_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("RLWATCH_RUN_INSTANCE", "trainer-0")
    with Watch(run="dup", port=0, store=str(tmp_path / "first.db"), alerts=False, sd_dir=str(tmp_path)) as first, \
            Watch(run="other", port=0, store=None, alerts=False, sd_dir=str(tmp_path)) as other, \
            Watch(run="dup", port=0, store=str(tmp_path / "second.db"), alerts=False, sd_dir=str(tmp_path)) as second:
        assert first.run_instance == other.run_instance == "trainer-0"   # another run may use the same one
        assert second.run_instance.startswith("trainer-0@") and second.run_instance != first.run_instance
        labels = {json.loads(p.read_text())[0]["targets"][0]: json.loads(p.read_text())[0]["labels"]["run_instance"]
                  for p in tmp_path.glob("*.json")}
        assert labels[f"127.0.0.1:{second.port}"] == second.run_instance
        assert labels[f"127.0.0.1:{first.port}"] == "trainer-0"
        assert second.errors.snapshot() == {("export", "duplicate_run_instance"): 1}
        assert not first.errors.snapshot() and not other.errors.snapshot()
        import urllib.request

        body = urllib.request.urlopen(second.url, timeout=5).read().decode()
        assert f'run_instance="{second.run_instance}"' in body and 'run_instance="trainer-0"' not in body
    from rlwatch.runs.store_reader import StoreReader

    with StoreReader(str(tmp_path / "second.db")) as reader:
        assert reader.meta("dup")["run_instance"] == second.run_instance
