"""How Prometheus finds a process that exports: file-based service discovery.

In a Ray job (verl, OpenRLHF) the hook runs inside an actor on whichever node Ray chose, on a
port nobody wrote down. ``Watch(sd_dir=...)`` (or ``$RLWATCH_SD_DIR``) writes one Prometheus
``file_sd`` target file per exporter into a directory that Prometheus watches
(``file_sd_configs: [{files: [<dir>/*.json]}]``) and removes it on close. Point ``sd_dir`` at a
directory Prometheus can read (a shared filesystem on a cluster, or the directory ``rlwatch up``
created on one node). The target address is the node's IP when the exporter binds all
interfaces, else the bound address.

Without either, a Watch registers with the newest stack ``rlwatch up`` started on this machine
(:func:`rlwatch.runs.stack.sd_directory`); ``sd_dir=""`` or ``RLWATCH_SD_DIR=""`` opts out. Each registration has
its own file, named after the run, the process (:func:`rlwatch.runs.procinfo.instance_id`) and its PID and network
namespaces, readable as far as the directory is; only the process that wrote it removes it (not a
child it forked). The entry of a process that died without closing stays for :data:`STALE_GRACE_S`
(long enough for RLWatchExporterDown to page), then the next registration, close or ``rlwatch up``
on its host removes it; under ``rlwatch run``, the entries of the processes that ended by a signal
are removed as soon as the command has ended (:func:`remove_if_dead`). A process is judged dead from
its PID only in its own PID namespace; an entry
of another one (a container sharing the hostname and the directory) is dead only when its endpoint
refuses connections. A registration that finds a live process already exporting its run under its
``run_instance`` (one $RLWATCH_RUN_INSTANCE given to two processes) makes its own unique
(:func:`rlwatch.hook.lifecycle.unique_run_instance`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import tempfile
import time
from typing import Any

from ..core.run_report import report
from . import procinfo, safefile

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


#: Seconds a probe of another namespace's endpoint waits for a connection.
PROBE_TIMEOUT_S = 0.5


class Registration:
    """One target file ``<directory>/rlwatch-<run>-<run digest>-<serial>@<host>-<pid>-<start>[+<namespaces>].json``,
    written atomically, its own per Watch: runs whose names differ only in characters a file name
    cannot hold, or two Watches of one run in one process, never share or remove each other's. Only
    the process that wrote it removes it (a child forked inside ``with Watch(...)`` that closes the
    Watch leaves it)."""

    def __init__(self, directory: str, run: str, address: str, port: int, labels: dict[str, str] | None = None):
        os.makedirs(directory, exist_ok=True)
        clean_stale(directory)
        self.owner = os.getpid()
        self.run = run
        self.labels = {"run": run, **(labels or {})}
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:80]
        digest = hashlib.sha256(run.encode()).hexdigest()[:8]
        spaces = procinfo.namespaces()
        name = f"rlwatch-{safe}-{digest}-{next(_serial)}@{procinfo.instance_id()}{'+' + spaces if spaces else ''}.json"
        self.path = os.path.join(directory, name)
        host = f"[{address}]" if ":" in address else address
        self.target = f"{host}:{port}"
        self._write()
        report("registered", path=self.path)        # rlwatch run removes it if this process dies by a signal

    def _write(self) -> None:
        directory = os.path.dirname(self.path)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".rlwatch-", suffix=".tmp")
        # Readable by whoever may read the directory (Prometheus often runs as its own user).
        os.fchmod(fd, 0o600 | (os.stat(directory).st_mode & 0o044))
        with os.fdopen(fd, "w") as f:
            json.dump([{"targets": [self.target], "labels": self.labels}], f)
        os.replace(tmp, self.path)            # Prometheus never reads a half-written file

    def relabel(self, **labels: str) -> None:
        """Rewrite the entry with ``labels`` changed."""
        self.labels.update(labels)
        self._write()

    def earlier_twins(self) -> list[str]:
        """The entries of live processes (this one included) that export this run with this entry's
        ``run_instance`` and registered before it: each would duplicate this process's series."""
        twins: list[str] = []
        directory, mine = os.path.split(self.path)
        try:
            me = (os.stat(self.path).st_mtime_ns, mine)
            names = os.listdir(directory)
        except OSError:
            return twins
        for name in names:
            path = os.path.join(directory, name)
            if name == mine or not _is_entry(name):
                continue
            try:
                labels = _read(path)[0]["labels"]
                if labels.get("run") != self.run or labels.get("run_instance") != self.labels.get("run_instance"):
                    continue
                if (os.stat(path).st_mtime_ns, name) < me and entry_alive(path) is True:
                    twins.append(path)
            except (OSError, ValueError, LookupError, TypeError, AttributeError):
                continue
        return twins

    def remove(self) -> None:
        """Remove the entry (only in the process that wrote it), then the stale ones."""
        if os.getpid() != self.owner:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        clean_stale(os.path.dirname(self.path))


def _is_entry(name: str) -> bool:
    return name.startswith("rlwatch-") and name.endswith(".json") and "@" in name


def _owner(name: str) -> tuple[str, str | None]:
    """(instance id, namespaces token or None) of the process that wrote entry ``name``."""
    instance, _, spaces = name[:-len(".json")].rpartition("@")[2].partition("+")
    return instance, spaces or None


#: Largest file_sd entry read, bytes (one is about 300 bytes).
MAX_ENTRY_BYTES = 65536


def _read(path: str) -> Any:
    """An entry's JSON: a regular file only, at most :data:`MAX_ENTRY_BYTES`, never through a
    symbolic link, never blocking (a FIFO or ``/dev/zero`` named like an entry raises OSError)."""
    return json.loads(safefile.read_text(path, MAX_ENTRY_BYTES))


def _same_host(instance: str) -> bool:
    return instance.rsplit("-", 2)[0] == socket.gethostname()


def entry_alive(path: str) -> bool | None:
    """Whether the process that wrote entry ``path`` still runs: from its PID where its PID namespace
    is this process's (same host); else by probing its endpoint (True: something accepts connections
    there; False: refused, where the address means the same here, i.e. not a loopback address of
    another network namespace); None when it cannot be told."""
    instance, spaces = _owner(os.path.basename(path))
    stale = procinfo.is_stale(instance, spaces)
    if stale is not None:
        return not stale
    try:
        host, _, port = _read(path)[0]["targets"][0].rpartition(":")
        host = host.strip("[]")
        port_number = int(port)
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return None
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    if loopback and (spaces is None or spaces.partition(".")[2] != (procinfo.namespaces() or "").partition(".")[2]):
        return None                       # another network namespace's loopback: not reachable from here
    try:
        with socket.create_connection((host, port_number), timeout=PROBE_TIMEOUT_S):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def remove_if_dead(paths: list[str]) -> list[str]:
    """Remove each entry of ``paths`` whose process has ended (a process of this host and PID
    namespace only): ``rlwatch run`` calls it once its command ended, so that a run stopped by a
    signal (SIGTERM, SIGHUP, ...) unregisters at once instead of paging RLWatchExporterDown.
    Returns the paths removed; never raises."""
    removed = []
    for path in paths:
        name = os.path.basename(path)
        instance, spaces = _owner(name) if _is_entry(name) else ("", None)
        if not instance or procinfo.is_stale(instance, spaces) is not True:
            continue
        for stale in (path, os.path.join(os.path.dirname(path), f".{name}.dead")):
            try:
                os.remove(stale)
            except OSError:
                continue
            if stale == path:
                removed.append(path)
    return removed


def clean_stale(directory: str, grace: float = STALE_GRACE_S) -> list[str]:
    """Remove the entries of this host's processes that died without closing their Watch, ``grace``
    seconds after first seeing each dead (a hidden ``.<entry>.dead`` marker records when); returns
    the paths removed. A process of another PID namespace (a container sharing the hostname) is seen
    dead only when its endpoint refuses connections. Never raises."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        marker = os.path.join(directory, f".{name}.dead")
        if _is_entry(name):
            if not _same_host(_owner(name)[0]):
                continue                   # another host's process: its own host cleans
            path = os.path.join(directory, name)
            alive = entry_alive(path)
            try:
                if alive is True and os.path.exists(marker):
                    os.remove(marker)      # a probe that failed once, then answered
                if alive is not False:
                    continue
                if not os.path.exists(marker):
                    open(marker, "x").close()
                if now - os.stat(marker).st_mtime >= grace:
                    os.remove(path)
                    os.remove(marker)
                    removed.append(path)
            except OSError:
                continue
        elif name.startswith(".rlwatch-") and name.endswith(".json.dead") and name[1:-5] not in names:
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass
    return removed
