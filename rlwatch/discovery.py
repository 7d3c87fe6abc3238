"""How Prometheus finds a process that exports: file-based service discovery.

In a Ray job (verl, OpenRLHF) the hook runs inside an actor on whichever node Ray chose, on a
port nobody wrote down. ``Watch(sd_dir=...)`` (or ``$RLWATCH_SD_DIR``) writes one Prometheus
``file_sd`` target file per exporter into a directory that Prometheus watches
(``file_sd_configs: [{files: [<dir>/*.json]}]``) and removes it on close. Point ``sd_dir`` at a
directory Prometheus can read (a shared filesystem on a cluster, or the directory ``rlwatch up``
created on one node). The target address is the node's IP when the exporter binds all
interfaces, else the bound address.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile

SD_ENV = "RLWATCH_SD_DIR"


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
    """One target file ``<directory>/rlwatch-<run>-<run_instance>.json`` (``<host>-<pid>`` without a
    ``run_instance`` label), written atomically."""

    def __init__(self, directory: str, run: str, address: str, port: int, labels: dict[str, str] | None = None):
        os.makedirs(directory, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:80]
        instance = (labels or {}).get("run_instance") or f"{socket.gethostname()}-{os.getpid()}"
        self.path = os.path.join(directory, f"rlwatch-{safe}-{instance}.json")
        host = f"[{address}]" if ":" in address else address
        body = [{"targets": [f"{host}:{port}"], "labels": {"run": run, **(labels or {})}}]
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".rlwatch-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.path)            # Prometheus never reads a half-written file

    def remove(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
