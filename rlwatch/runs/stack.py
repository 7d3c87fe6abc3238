"""``rlwatch up`` / ``rlwatch down``: a local Prometheus + Alertmanager (+ Grafana) for rlwatch runs.

``up`` writes everything into one directory (Prometheus config whose targets come from
registration: a file_sd job reading ``<dir>/targets/*.json``, where each ``Watch(sd_dir=...)``
(or ``RLWATCH_SD_DIR``) writes its target and removes it when its run closes cleanly; static
targets only when asked for with ``--target``), the rlwatch rules, an Alertmanager config, and
Grafana provisioning when a Grafana binary exists), starts the binaries bound to 127.0.0.1 unless
told otherwise, and records their PIDs with each process's executable and start time; ``down``
signals a recorded PID only while it still names that same process (a reused or forged PID never, nor
PID <= 1). Each running stack is also listed under a well-known state directory (:func:`state_dir`),
so that ``rlwatch down`` run from any other directory finds it, and so does a Watch that registers
with it by default (:func:`sd_directory`).

The runbook: unless a runbook URL is configured (``--runbook-url``, $RLWATCH_RUNBOOK_URL), ``up`` also
starts a static server of the runbook (:mod:`rlwatch.runs.runbook_server` over ``<dir>/runbook-site``, default
port :data:`RUNBOOK_PORT`) and the rules it loads link there, so that a page that arrives after the run
ended still opens its runbook section; ``down`` stops it with the rest.

No fixed port list: a port nobody exports on is never a target, so RLWatchExporterDown fires only
for an exporter that registered, answered, and then stopped answering without closing its run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import procinfo, safefile
from ..core.config import state_dir  # noqa: F401 - where running stacks are listed (the CLI imports it from here)

# The rules renderer (half a second to import) is imported where configs are written: every Watch
# imports this module to look for a running stack (sd_directory).

logger = logging.getLogger(__name__)


#: The default port of the stack's runbook server (a static server of the runbook that outlives the runs).
RUNBOOK_PORT = 9097


class StackError(RuntimeError):
    """A binary is missing or a server did not start."""


def find_binary(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class StackConfig:
    directory: Path
    addr: str = "127.0.0.1"
    prometheus_port: int = 9090
    alertmanager_port: int = 9093
    grafana_port: int = 3000
    targets: list[str] = field(default_factory=list)     # static targets on top of the registered ones
    scrape_interval: str = "5s"
    webhook: str | None = None
    group_wait: str = "10s"              # Alertmanager's route timing (the demo's is shorter)
    group_interval: str = "1m"
    runbook_url: str | None = None       # None: $RLWATCH_RUNBOOK_URL, else the stack's own runbook server
    runbook_port: int = RUNBOOK_PORT     # the runbook server's port (started only when no URL is set)

    def __post_init__(self) -> None:
        # Prometheus resolves rule and file_sd paths against its config file's directory, so a
        # relative path (such as the default .rlwatch-stack) would point inside the stack directory.
        self.directory = Path(os.path.abspath(self.directory))

    @property
    def sd_dir(self) -> Path:
        return self.directory / "targets"

    @property
    def runbook_site(self) -> Path:
        """The directory the runbook server serves: ``index.html`` (the runbook, one anchor per alert)
        and ``runbook.md``."""
        return self.directory / "runbook-site"

    @property
    def serves_runbook(self) -> bool:
        """True when no runbook URL is configured (``runbook_url``, $RLWATCH_RUNBOOK_URL): the stack then
        serves the runbook itself and its rules link there."""
        from ..core.config import runbook_url

        return not runbook_url(self.runbook_url, "")

    def runbook_base(self) -> str:
        """Where the rules' ``runbook_url`` points: the configured URL, else the stack's runbook server."""
        from ..core.config import runbook_url

        host = self.addr if self.addr not in ("0.0.0.0", "::", "") else socket.getfqdn()
        host = f"[{host}]" if ":" in host else host
        return runbook_url(self.runbook_url, f"http://{host}:{self.runbook_port}/")


def prometheus_config(cfg: StackConfig) -> dict:
    from ..alerts import render

    return {
        "global": {"scrape_interval": cfg.scrape_interval, "evaluation_interval": cfg.scrape_interval},
        "rule_files": [str(cfg.directory / render.RULES_FILE)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"{cfg.addr}:{cfg.alertmanager_port}"]}]}]},
        "scrape_configs": [
            # Exporters registered by Watch(sd_dir=...) anywhere Ray placed them.
            {"job_name": "rlwatch-sd", "honor_labels": True,
             "file_sd_configs": [{"files": [str(cfg.sd_dir / "*.json")], "refresh_interval": "5s"}]},
        ] + ([{"job_name": "rlwatch", "honor_labels": True, "static_configs": [{"targets": cfg.targets}]}]
             if cfg.targets else []),
    }


def alertmanager_config(cfg: StackConfig) -> dict:
    from ..alerts import render

    config = render.alertmanager_example()
    config["route"].update(group_wait=cfg.group_wait, group_interval=cfg.group_interval)
    if cfg.webhook:
        receivers = [{"name": n, "webhook_configs": [{"url": cfg.webhook, "send_resolved": True}]}
                     for n in ("pager", "chat", "heartbeat")]
    else:   # nothing to deliver to yet: alerts stay visible in the Alertmanager UI
        receivers = [{"name": n} for n in ("pager", "chat", "heartbeat")]
    config["receivers"] = receivers
    return config


def _grafana_provisioning(cfg: StackConfig) -> Path:
    from . import resources
    from ..alerts import render

    prov = cfg.directory / "grafana" / "provisioning"
    (prov / "datasources").mkdir(parents=True, exist_ok=True)
    (prov / "dashboards").mkdir(parents=True, exist_ok=True)
    dash_dir = cfg.directory / "grafana" / "dashboards"
    dash_dir.mkdir(parents=True, exist_ok=True)
    for path in resources.dashboards():          # shipped in the package (rlwatch/_data/dashboards)
        safefile.write_text(dash_dir / path.name, path.read_text(encoding="utf-8"))
    safefile.write_text(prov / "datasources" / "rlwatch.yaml", render.to_yaml({
        "apiVersion": 1,
        "datasources": [{"name": "Prometheus", "uid": "prometheus", "type": "prometheus", "access": "proxy",
                         "url": f"http://{cfg.addr}:{cfg.prometheus_port}", "isDefault": True}]}))
    safefile.write_text(prov / "dashboards" / "rlwatch.yaml", render.to_yaml({
        "apiVersion": 1,
        "providers": [{"name": "rlwatch", "folder": "rlwatch", "type": "file",
                       "options": {"path": str(dash_dir)}}]}))
    return prov


def runbook_command(cfg: StackConfig) -> list[str]:
    """The command of the stack's runbook server (:mod:`rlwatch.runs.runbook_server`: idle
    connections cut, threads bounded)."""
    return [sys.executable, "-m", "rlwatch.runs.runbook_server", str(cfg.runbook_port), "--bind", cfg.addr,
            "--directory", str(cfg.runbook_site)]


def write_configs(cfg: StackConfig) -> None:
    from . import resources
    from ..alerts import render

    cfg.directory.mkdir(parents=True, exist_ok=True)
    cfg.sd_dir.mkdir(exist_ok=True)
    safefile.write_text(cfg.directory / render.RULES_FILE, render.rules_yaml(cfg.runbook_base()))
    safefile.write_text(cfg.directory / render.RUNBOOK_FILE, resources.runbook_markdown())
    cfg.runbook_site.mkdir(exist_ok=True)
    safefile.write_text(cfg.runbook_site / "index.html", resources.runbook_html())
    safefile.write_text(cfg.runbook_site / render.RUNBOOK_FILE, resources.runbook_markdown())
    safefile.write_text(cfg.directory / "prometheus.yml", render.to_yaml(prometheus_config(cfg)))
    safefile.write_text(cfg.directory / "alertmanager.yml", render.to_yaml(alertmanager_config(cfg)))


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, addr: str, port: int, timeout: float = 30.0) -> None:
    """Until ``url`` answers 200 from ``proc`` itself: another server answering on the port does not count."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(port_owner(addr, port) or f"{proc.args[0]} exited with {proc.returncode}:\n"
                                                        f"{log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200 and listener_pid(port) in (proc.pid, None):
                    return
                time.sleep(0.2)
        except Exception:  # noqa: BLE001
            time.sleep(0.2)
    raise StackError(f"{url} not ready after {timeout:.0f}s; see {log}")


def _start(args: list[str], log: Path, started: dict, name: str, url: str, directory: Path) -> subprocess.Popen:
    """Start ``args`` and record it in ``started`` and pids.json: PID, URL and its identity (procinfo)."""
    handle = safefile.open_append(log)           # never through a link already in the directory
    try:
        # A new session: the servers outlive the `rlwatch up` command, and `down` stops them by PID.
        proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        os.close(handle)
    started[name] = {"pid": proc.pid, "url": url, **(procinfo.identity(proc.pid) or {})}
    _save(directory, started)
    return proc


def listener_pid(port: int) -> int | None:
    """The PID of this user's process listening on TCP ``port`` (Linux: /proc/net/tcp*), else None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                rows = [line.split() for line in handle.readlines()[1:]]
        except OSError:
            continue
        inodes |= {row[9] for row in rows if row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port}
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes} for fd in fds):
                return int(pid)
        except OSError:
            continue
    return None


def port_owner(addr: str, port: int) -> str | None:
    """None when ``addr:port`` is free, else one line saying what holds it."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
            return None
        except OSError as exc:
            reason = exc.strerror or str(exc)
    pid = listener_pid(port)
    for directory, processes in running_stacks().items():
        for name, info in processes.items():
            if info["pid"] == pid or info.get("url", "").endswith(f":{port}"):
                return (f"port {port} on {addr} is taken by the {name} of the rlwatch stack in {directory} "
                        f"(pid {info['pid']}): stop it with `rlwatch down --dir {directory}` or choose other ports")
    if pid is not None:
        exe = procinfo.executable(pid) or "?"
        return f"port {port} on {addr} is taken by process {pid} ({exe}): stop it or choose another port"
    return f"port {port} on {addr} is not available ({reason}): choose another port"


def up(cfg: StackConfig) -> dict[str, dict]:
    """Start the stack; returns {name: {"pid": ..., "url": ...}} (also written to <dir>/pids.json)."""
    prometheus = find_binary("prometheus")
    alertmanager = find_binary("prometheus-alertmanager", "alertmanager")
    missing = [package for package, path in (("prometheus", prometheus), ("prometheus-alertmanager", alertmanager))
               if path is None]
    if missing:
        raise StackError(f"missing {', '.join(missing)}: install the Debian packages with "
                         f"`sudo apt-get install -y --no-install-recommends {' '.join(missing)}` "
                         f"(or put the binaries on PATH)")
    if (cfg.directory / "pids.json").exists() and running(cfg.directory):
        raise StackError(f"a stack is already running from {cfg.directory}; run `rlwatch down --dir {cfg.directory}`")
    grafana = find_binary("grafana-server", "grafana")
    for port in ((cfg.alertmanager_port, cfg.prometheus_port) + ((cfg.grafana_port,) if grafana else ())
                 + ((cfg.runbook_port,) if cfg.serves_runbook else ())):
        taken = port_owner(cfg.addr, port)
        if taken:
            raise StackError(taken)
    write_configs(cfg)
    from .discovery import clean_stale

    clean_stale(str(cfg.sd_dir))
    started: dict[str, dict] = {}
    try:
        if cfg.serves_runbook:       # a static server of the runbook: the alerts' links work after the run
            url = cfg.runbook_base()
            runbook = _start(runbook_command(cfg), cfg.directory / "runbook.log", started, "runbook", url,
                             cfg.directory)
            _wait_ready(f"http://{cfg.addr}:{cfg.runbook_port}/index.html", runbook, cfg.directory / "runbook.log",
                        cfg.addr, cfg.runbook_port)
        url = f"http://{cfg.addr}:{cfg.alertmanager_port}"
        am = _start([alertmanager, f"--config.file={cfg.directory / 'alertmanager.yml'}",
                     f"--storage.path={cfg.directory / 'alertmanager-data'}",
                     f"--web.listen-address={cfg.addr}:{cfg.alertmanager_port}", "--cluster.listen-address="],
                    cfg.directory / "alertmanager.log", started, "alertmanager", url, cfg.directory)
        _wait_ready(url + "/-/ready", am, cfg.directory / "alertmanager.log", cfg.addr, cfg.alertmanager_port)
        url = f"http://{cfg.addr}:{cfg.prometheus_port}"
        prom = _start([prometheus, f"--config.file={cfg.directory / 'prometheus.yml'}",
                       f"--storage.tsdb.path={cfg.directory / 'prometheus-data'}",
                       f"--web.listen-address={cfg.addr}:{cfg.prometheus_port}", "--web.enable-lifecycle",
                       "--rules.alert.resend-delay=5s"], cfg.directory / "prometheus.log", started, "prometheus",
                      url, cfg.directory)
        _wait_ready(url + "/-/ready", prom, cfg.directory / "prometheus.log", cfg.addr, cfg.prometheus_port)
        if grafana:
            prov = _grafana_provisioning(cfg)
            args = [grafana] + (["server"] if grafana.endswith("/grafana") else [])
            home = next((p for p in ("/usr/share/grafana", "/usr/local/share/grafana") if os.path.isdir(p)), None)
            args += [f"--homepath={home}"] if home else []
            env_cfg = cfg.directory / "grafana" / "grafana.ini"
            safefile.write_text(env_cfg, f"[server]\nhttp_addr = {cfg.addr}\nhttp_port = {cfg.grafana_port}\n"
                               f"[paths]\nprovisioning = {prov}\ndata = {cfg.directory / 'grafana' / 'data'}\n")
            _start(args + [f"--config={env_cfg}"], cfg.directory / "grafana.log", started, "grafana",
                   f"http://{cfg.addr}:{cfg.grafana_port}", cfg.directory)
    except Exception:
        down(cfg.directory)
        raise
    _register(cfg.directory)
    return started


def _save(directory: Path, started: dict) -> None:
    safefile.write_text(directory / "pids.json", json.dumps(started, indent=2))


def _ours(info: object) -> bool:
    """True when a pids.json entry still names the very process ``up`` started (never PID <= 1)."""
    return isinstance(info, dict) and procinfo.same_process(info.get("pid"), info)


def _recorded(directory: Path) -> dict[str, dict]:
    try:
        recorded = json.loads(safefile.read_text(Path(directory) / "pids.json"))
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def running(directory: Path) -> dict[str, dict]:
    """The processes ``up`` started from ``directory`` that still run: {name: {"pid", "url", ...}}."""
    return {name: info for name, info in _recorded(directory).items() if _ours(info)}


def down(directory: Path, timeout: float = 10.0) -> list[str]:
    """Stop the processes ``up`` started from ``directory`` (by PID, each only while that PID still names
    the process ``up`` started); returns their names."""
    path = Path(directory) / "pids.json"
    if not path.exists():
        return []
    stopped = []
    for name, info in _recorded(directory).items():
        if not _ours(info):
            pid = info.get("pid") if isinstance(info, dict) else info
            if isinstance(pid, int) and pid > 1 and procinfo.identity(pid) is not None:
                logger.warning("rlwatch down: left process %s alone: it is not the %s `rlwatch up` started "
                               "(%s)", pid, name, procinfo.executable(pid))
            continue
        pid = info["pid"]
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while procinfo.start_time(pid) == info["start"] and time.monotonic() < deadline:   # until reaped
            _reap(pid)
            time.sleep(0.1)
        if _ours(info):
            os.kill(pid, signal.SIGKILL)
        _reap(pid)
        stopped.append(name)
    path.unlink()
    _unregister(Path(directory))
    return stopped


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)          # when `up` ran in this same process (tests)
    except ChildProcessError:
        pass


# --- finding a stack from anywhere -----------------------------------------------------------------



def _entry(directory: Path) -> Path:
    import hashlib

    digest = hashlib.sha256(str(Path(os.path.abspath(directory))).encode()).hexdigest()[:16]
    return state_dir() / "stacks" / f"{digest}.json"


def _register(directory: Path) -> None:
    try:
        entry = _entry(directory)
        entry.parent.mkdir(parents=True, exist_ok=True)
        listed = {"directory": os.path.abspath(directory), "host": socket.gethostname()}
        safefile.write_text(entry, json.dumps(listed))
    except OSError:
        pass             # the stack runs all the same; `down` then needs --dir


def _unregister(directory: Path) -> None:
    try:
        _entry(directory).unlink()
    except OSError:
        pass


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def served_runbook(sd_dir: str | None) -> str | None:
    """The runbook URL of the running stack on this host whose targets directory is ``sd_dir`` (where a
    Watch registered), when that stack serves the runbook; else None."""
    if not sd_dir:
        return None
    try:
        info = running(Path(sd_dir).parent).get("runbook")
    except Exception:  # noqa: BLE001 - never disturbs the Watch
        return None
    return info.get("url") if isinstance(info, dict) else None


def sd_directory(chosen: str | bool | None) -> str | None:
    """Where a Watch registers: ``chosen`` (its option or $RLWATCH_SD_DIR; False: opted out), else the
    targets directory of the newest stack ``rlwatch up`` started on this machine, else None."""
    if chosen is not None:
        return chosen or None
    try:
        stacks = [d for d, processes in running_stacks().items() if "prometheus" in processes]
    except Exception as exc:  # noqa: BLE001 - looking for a stack never disturbs the Watch
        logger.debug("rlwatch: no local stack found: %s", exc)
        return None
    if not stacks:
        return None
    logger.info("rlwatch: registering with the Prometheus `rlwatch up` started in %s (opt out: RLWATCH_SD_DIR= "
                "or Watch(sd_dir=''))", stacks[0])
    return str(stacks[0] / "targets")


def running_stacks() -> dict[Path, dict[str, dict]]:
    """Every stack ``up`` started on this host that still has a live process: {directory: running(directory)},
    newest first. Entries of stacks that stopped on their own are removed."""
    stacks: dict[Path, dict[str, dict]] = {}
    entries = sorted((state_dir() / "stacks").glob("*.json"), key=_mtime, reverse=True)
    for entry in entries:
        try:
            listed = json.loads(safefile.read_text(entry))
            if listed.get("host", socket.gethostname()) != socket.gethostname():
                continue                 # a shared state directory: another host's stack is not ours to judge
            directory = Path(listed["directory"])
            alive = running(directory)
        except (OSError, ValueError, KeyError, AttributeError):
            alive = {}
            directory = None
        if alive and directory is not None:
            stacks[directory] = alive
        else:
            try:
                entry.unlink()
            except OSError:
                pass
    return stacks
