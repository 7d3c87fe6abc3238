"""How Prometheus finds a process that exports: file-based service discovery.

In a Ray job (verl, OpenRLHF) the hook runs inside an actor on whichever node Ray chose, on a
port nobody wrote down. ``Watch(sd_dir=...)`` (or ``$RLWATCH_SD_DIR``) writes one Prometheus
``file_sd`` target file per exporter into a directory that Prometheus watches
(``file_sd_configs: [{files: [<dir>/*.json]}]``) and removes it on close. Point ``sd_dir`` at a
directory Prometheus can read (a shared filesystem on a cluster, or the directory ``rlwatch up``
created on one node). The target address is the node's IP when the exporter binds all
interfaces, else the bound address.

Without either, a Watch registers with the newest stack ``rlwatch up`` started on this machine
(:func:`rlwatch.stack.sd_directory`); ``sd_dir=""`` or ``RLWATCH_SD_DIR=""`` opts out. Each registration has its own
file, named after the run and the process (:func:`rlwatch.procinfo.instance_id`), readable as far as
the directory is. The entry of a process that died without closing stays for :data:`STALE_GRACE_S`
(long enough for RLWatchExporterDown to page), then the next registration, close or ``rlwatch up``
on its host removes it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import tempfile
import time

from . import procinfo

SD_ENV = "RLWATCH_SD_DIR"
#: Seconds a dead process's entry stays after a cleaner first saw it dead (RLWatchExporterDown: for 1m).
STALE_GRACE_S = 600.0
_serial = itertools.count()


def node_address(bind_addr: str) -> str:
    """The address other hosts reach this exporter at."""
    if bind_addr not in ("0.0.0.0", "::", ""):
        return bind_addr
    try:
        import ray  # noqa: F401 - only to ask Ray which IP it uses for this node

        from ray.util import get_node_ip_address

        return get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in Ray: ask the routing table
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(("10.255.255.255", 1))   # no packet is sent by a UDP connect
                return sock.getsockname()[0]
            except OSError:
                return socket.gethostbyname(socket.gethostname())


class Registration:
    """One target file ``<directory>/rlwatch-<run>-<run digest>-<serial>@<host>-<pid>-<start>.json``,
    written atomically, its own per Watch: runs whose names differ only in characters a file name
    cannot hold, or two Watches of one run in one process, never share or remove each other's."""

    def __init__(self, directory: str, run: str, address: str, port: int, labels: dict[str, str] | None = None):
        os.makedirs(directory, exist_ok=True)
        clean_stale(directory)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:80]
        digest = hashlib.sha256(run.encode()).hexdigest()[:8]
        name = f"rlwatch-{safe}-{digest}-{next(_serial)}@{procinfo.instance_id()}.json"
        self.path = os.path.join(directory, name)
        host = f"[{address}]" if ":" in address else address
        body = [{"targets": [f"{host}:{port}"], "labels": {"run": run, **(labels or {})}}]
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".rlwatch-", suffix=".tmp")
        # Readable by whoever may read the directory (Prometheus often runs as its own user).
        os.fchmod(fd, 0o600 | (os.stat(directory).st_mode & 0o044))
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.path)            # Prometheus never reads a half-written file

    def remove(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        clean_stale(os.path.dirname(self.path))


def clean_stale(directory: str, grace: float = STALE_GRACE_S) -> list[str]:
    """Remove the entries of this host's processes that died without closing their Watch, ``grace``
    seconds after first seeing each dead (a hidden ``.<entry>.dead`` marker records when); returns
    the paths removed. Never raises."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        marker = os.path.join(directory, f".{name}.dead")
        if name.startswith("rlwatch-") and name.endswith(".json") and "@" in name:
            if not procinfo.is_stale(name[:-len(".json")].rpartition("@")[2]):
                continue
            try:
                if not os.path.exists(marker):
                    open(marker, "x").close()
                if now - os.stat(marker).st_mtime >= grace:
                    os.remove(os.path.join(directory, name))
                    os.remove(marker)
                    removed.append(os.path.join(directory, name))
            except OSError:
                continue
        elif name.startswith(".rlwatch-") and name.endswith(".json.dead") and name[1:-5] not in names:
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass
    return removed
