"""The file_sd directory and `rlwatch up`'s directory written by someone else: a FIFO or a link to
/dev/zero named like an entry, links planted where `rlwatch up` writes. Real files, real processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs and /dev/zero: Linux")

WATCH = """
import resource, sys
import rlwatch
from tests.conftest import make_step
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))       # /dev/zero read whole would pass this
with rlwatch.Watch(run="victim", port=0, store=None, alerts=False, sd_dir=sys.argv[1]) as watch:
    watch.observe(0, **make_step())
    print("registered", watch.registration is not None, flush=True)
print("closed", flush=True)
"""


def _entry_name(host: str) -> str:
    return f"rlwatch-evil-00000000-0@{host}-1-abc.json"


@pytest.mark.parametrize("plant", ["fifo", "dev_zero", "dir"])
def test_a_fifo_or_dev_zero_in_the_sd_directory_never_blocks_nor_exhausts_a_watch(tmp_path, plant):
    """A FIFO nobody writes, a symbolic link to /dev/zero, a directory, each named like another
    host's entry (read by the duplicate-run check) and like this host's (probed): the Watch
    registers, closes, and leaves the planted names as they were, within 60 s and 4 GiB."""
    sd_dir = tmp_path / "targets"
    sd_dir.mkdir()
    planted = [sd_dir / _entry_name("elsewhere"), sd_dir / _entry_name(socket.gethostname())]
    for path in planted:
        if plant == "fifo":
            os.mkfifo(path)
        elif plant == "dev_zero":
            os.symlink("/dev/zero", path)
        else:
            path.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", WATCH, str(sd_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, err
    assert out.split("\n")[:2] == ["registered True", "closed"], (out, err)
    assert all(os.path.lexists(path) for path in planted)


def test_rlwatch_up_never_writes_through_links_already_in_its_directory(tmp_path):
    """Links planted in `rlwatch up`'s directory where it writes its configs, pids.json and logs:
    each config is written as a new file in place of the link, the victims are untouched, and a log
    opened through a link is refused."""
    from rlwatch.runs import safefile
    from rlwatch.runs.stack import StackConfig, _save, write_configs

    directory = tmp_path / "stack"
    (directory / "runbook-site").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    names = ["prometheus.yml", "alertmanager.yml", "rlwatch-rules.yaml", "pids.json", "runbook-site/index.html"]
    for name in names:
        os.symlink(victim, directory / name)
    write_configs(StackConfig(directory))
    _save(directory, {"prometheus": {"pid": 1}})
    assert victim.read_text() == "precious\n"
    for name in names:
        assert not (directory / name).is_symlink() and (directory / name).is_file(), name
    assert json.loads((directory / "pids.json").read_text()) == {"prometheus": {"pid": 1}}
    os.symlink(victim, directory / "prometheus.log")
    with pytest.raises(OSError):
        safefile.open_append(directory / "prometheus.log")
    assert victim.read_text() == "precious\n"
    with pytest.raises(OSError):
        safefile.read_bytes(Path("/dev/zero"))
