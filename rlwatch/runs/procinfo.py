"""Which process a PID names now: its executable and start time, so that a PID written down earlier
(``rlwatch up``'s pids.json, a file_sd entry) is only trusted while it still names the same process.

Linux reads ``/proc``; elsewhere ``ps`` answers. A process this user may not inspect has no identity.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (an opaque string: clock ticks since boot on Linux), or None when
    there is no such process (or it cannot be inspected)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode(errors="replace")
        return stat[stat.rindex(")") + 2:].split()[19]       # field 22; the name in (...) may hold spaces
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, ValueError, IndexError):
        return None
    return _ps(pid, "lstart=")


def executable(pid: int) -> str | None:
    """The path of the program process ``pid`` runs, or None."""
    if pid <= 0:
        return None
    try:
        return os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")   # the package was upgraded since
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except OSError:
        return None
    return _ps(pid, "comm=")


def identity(pid: int) -> dict[str, str] | None:
    """``{"exe": ..., "start": ...}`` of process ``pid``, or None when it is gone or not inspectable."""
    exe, start = executable(pid), start_time(pid)
    return {"exe": exe, "start": start} if exe and start else None


def same_process(pid: int, recorded: dict | None) -> bool:
    """True when ``pid`` (> 1) still names the process whose :func:`identity` was ``recorded``."""
    if not isinstance(pid, int) or pid <= 1 or not recorded:
        return False
    now = identity(pid)
    return now is not None and now["exe"] == recorded.get("exe") and now["start"] == recorded.get("start")


def instance_id(pid: int | None = None) -> str:
    """``<hostname>-<pid>-<start time, base 36>``: one process on one host, even after its PID is reused."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}-{pid}-{_start_token(start_time(pid))}"


def namespaces() -> str | None:
    """This process's PID and network namespaces as ``<pid ns>.<net ns>`` (Linux: the inode numbers of
    ``/proc/self/ns/pid`` and ``/proc/self/ns/net``), or None where there are none. Two containers that
    share a hostname see each other's PIDs only with the same PID namespace, and each other's
    loopback only with the same network namespace."""
    inodes = []
    for kind in ("pid", "net"):
        try:
            link = os.readlink(f"/proc/self/ns/{kind}")        # "pid:[4026531836]"
        except OSError:
            return None
        digits = link.rpartition("[")[2].rstrip("]")
        if not digits.isdigit():
            return None
        inodes.append(digits)
    return ".".join(inodes)


def is_stale(instance: str, namespaces_token: str | None = None) -> bool | None:
    """Whether :func:`instance_id` ``instance``, written by a process with :func:`namespaces`
    ``namespaces_token``, names a process that no longer runs: True or False for a process of this host
    and this PID namespace; None (not ours to judge) for another host's, or another PID namespace's
    (a container sharing the hostname: its PID names nothing here)."""
    parts = instance.rsplit("-", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return None
    if _pid_part(namespaces_token) != _pid_part(namespaces()):
        return None
    return _start_token(start_time(int(parts[1]))) != parts[2]


def _pid_part(token: str | None) -> str | None:
    return None if token is None else token.partition(".")[0]


def _start_token(start: str | None) -> str:
    if start is None:
        return "gone"
    if not start.isdigit():
        return hashlib.sha1(start.encode()).hexdigest()[:8]      # ps' date: any stable short token
    number, digits = int(start), ""
    while True:
        number, digit = divmod(number, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
        if not number:
            return digits


def _ps(pid: int, column: str) -> str | None:
    try:
        out = subprocess.run(["ps", "-o", column, "-p", str(pid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
