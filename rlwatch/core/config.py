"""Every option of a ``Watch``, and the one place rlwatch reads its ``RLWATCH_*`` variables.

:class:`WatchConfig` holds the constructor's arguments and documents each (``Watch(**options)`` and
``WatchConfig(**options)`` accept the same names; the signal thresholds among them come from their
declaration, ``rlwatch.signals.quantities.SIGNAL_THRESHOLDS``). The functions below read the environment;
no other module reads an ``RLWATCH_*`` variable (integrations call :func:`env_watch_options`,
:func:`env_flag`, :func:`disabled` and :func:`rlwatch_variables`).

Variables:

==========================  ===================================================================
RLWATCH_RUN                 run name (default: the trainer's own name, else a timestamp)
RLWATCH_RUN_INSTANCE        this process's ``run_instance`` label (default ``<host>-<pid>-<start>``)
RLWATCH_PORT                metrics port; ``none``/``off``/``-1`` = no endpoint
RLWATCH_ADDR                bind address
RLWATCH_PORT_FALLBACK       try the next ports when taken (default on, for delivered hooks)
RLWATCH_STORE               run-store path; ``none``/``off``/``0`` = no store
RLWATCH_DIR                 directory of the automatic run stores (default ``rlwatch-runs``)
RLWATCH_SD_DIR              Prometheus file_sd directory to register in (empty: none; unset: a local stack's)
RLWATCH_<THRESHOLD>         a signal threshold by its name in capitals (RLWATCH_STALENESS_BOUND, RLWATCH_IS_CAP,
                            RLWATCH_MIS_BAND=low,high, ...: ``rlwatch.signals.quantities.SIGNAL_THRESHOLDS``)
RLWATCH_GROUP_SIZE          expected GRPO group size (0: no check)
RLWATCH_STRICT              raise instead of counting errors (tests)
RLWATCH_DISABLE             the Ray worker setup hook does nothing
RLWATCH_FRAMEWORKS          comma list of frameworks ``rlwatch run`` instruments (default all)
RLWATCH_RUN_REPORT          file where delivered hooks report what they watch (set by ``rlwatch run``)
RLWATCH_TRAINER_LOGS        put rlwatch's headline signals into the trainer's own logs (default on)
RLWATCH_STATE_DIR           where running stacks are listed (default $XDG_STATE_HOME/rlwatch)
RLWATCH_RUNBOOK_URL         base URL of the runbook the alerts link to
RLWATCH_COMPILE             when the signal engine compiles: ``auto`` (CUDA only), ``always``, ``never``
==========================  ===================================================================
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

PREFIX = "RLWATCH_"
DEFAULT_PORT = 9400
DEFAULT_STORE_DIR = "rlwatch-runs"
#: ``rlwatch run`` option -> the variable that carries it into the trainer's processes.
OPTION_VARIABLES = {"run": "RLWATCH_RUN", "port": "RLWATCH_PORT", "addr": "RLWATCH_ADDR",
                    "store": "RLWATCH_STORE", "sd_dir": "RLWATCH_SD_DIR", "frameworks": "RLWATCH_FRAMEWORKS"}
_OFF = ("none", "off")


@dataclass
class _Options:
    run: str | None = None
    port: int | None = DEFAULT_PORT
    addr: str = "127.0.0.1"
    port_fallback: bool = False
    store: str | None = "auto"
    env_cap: int = 64
    reward_bounds: tuple[float, float] | None = None
    group_size: int | None = None
    strict: bool = False
    pushgateway: str | None = None
    push_interval: float = 10.0
    otel: Any = None
    alerts: bool | None = None
    notifiers: tuple = ()
    all_ranks: bool = False
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    basic_auth: tuple[str, str] | None = None
    framework: str = "custom"
    framework_version: str = ""
    metadata: Mapping[str, Any] | None = None
    alert_overrides: Mapping[str, float] | None = None
    guard: tuple[Callable, ...] = ()
    sd_dir: str | None = None
    hack_detectors: Any = None
    listeners: tuple = ()
    background: bool = False
    background_max_bytes: int = 256 << 20


class WatchConfig(_Options):
    """Every ``Watch`` option (``Watch(**options)`` and ``WatchConfig(**options)`` accept the same names,
    with the same defaults; a misspelt one raises TypeError).

    Args:
        run: run name, the ``run`` label of every series (default: $RLWATCH_RUN or a timestamp).
        port: /metrics port on ``addr`` (default 9400; 0 = any free port; None = no endpoint).
        addr: bind address, 127.0.0.1 unless you ask otherwise.
        port_fallback: when the port is taken, try the next ones instead of failing.
        store: SQLite run-store path; "auto" (default) = $RLWATCH_DIR (./rlwatch-runs)/<run>.db;
            None disables it.
        staleness_bound, is_cap, mis_band, ...: the signal thresholds, one keyword each, declared in
            ``rlwatch.signals.quantities.SIGNAL_THRESHOLDS`` with their defaults, ranges and meanings
            (``SignalConfig``, the runbook's "Signal settings"); a value outside its range raises ValueError.
        reward_bounds, group_size: see :class:`~rlwatch.signals.SignalConfig`.
        env_cap: distinct environment labels kept per run; the rest become "other".
        strict: raise on any error (tests); default False counts and logs instead.
        pushgateway: URL of a Pushgateway to push to every ``push_interval`` seconds and at close.
        otel: an OpenTelemetry MeterProvider (or True for the global one) to export through.
        alerts: evaluate the alert catalogue in-process (default: whenever a store is written).
        notifiers: alert notifiers (webhook, Slack) for the in-process evaluator.
        alert_overrides: per-run alert thresholds ({param: value}, see rlwatch.alerts.catalogue.PARAMS);
            an unknown name or a value outside the parameter's range raises ValueError.
        guard: callables run with the event when a critical alert fires (checkpoint, stop, ...), on
            rlwatch's alert-actions thread, outside rlwatch's locks; the step that fired waits for
            them at most 100 ms, a slower guard finishes on its own. A guard that raises is counted.
        all_ranks: export from every rank (run label "<run>-rank<N>", port + local rank) instead
            of rank 0 only.
        tls_certfile, tls_keyfile, basic_auth: protect /metrics with TLS and/or (user, password).
        sd_dir: register the endpoint in a Prometheus file_sd directory (default $RLWATCH_SD_DIR, else
            the stack ``rlwatch up`` started on this machine; "" = nowhere), so Prometheus finds
            exporters that Ray placed on any node (see rlwatch.runs.discovery).
        hack_detectors: reward-hack detectors (names or rlwatch.hacks.Detector) run on the ``episodes``
            passed to observe, off the training thread; None = every registered detector (the
            built-ins included), False = none.
        framework, framework_version, metadata: recorded in the store and ``rlwatch_run_info``.
        background: compute each observed step on one rlwatch thread, in order, so that
            ``observe`` returns at once (None); for trainers on an accelerator, whose training
            thread would otherwise wait for the device's queue at the step's one transfer. On a CPU
            trainer that keeps every core busy the thread only competes with it (measured slower
            than computing inline, ``bench/bench_trl_overhead.py``). The tensors passed must
            not be modified in place afterwards. ``flush()`` waits for the queued steps; guards
            and ``on_alert`` callbacks then come a step or so later. Off in strict mode.
        background_max_bytes: bytes of input tensors the background queue may hold (default 256 MiB;
            a queued step keeps its tensors alive, on an accelerator in device memory): when full,
            ``observe`` waits for rlwatch's thread (at most 5 s, then the step is dropped, counted).
        listeners: extra :class:`~rlwatch.hook.pipeline.StepListener` run after drift, diagnosis and the
            alert step windows, before the alert evaluator (``watch.listeners``, a
            :class:`~rlwatch.hook.pipeline.StepListeners`, holds every listener by phase; an error in one of
            these is counted under ``stage="listener"``).
    """

    def __init__(self, **options: Any) -> None:
        from ..signals.quantities import threshold_values

        declared, known = _threshold_names(), self.names()
        unknown = [name for name in options if name not in known]
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (the options: WatchConfig's fields)")
        super().__init__(**{k: v for k, v in options.items() if k not in declared})
        for name, value in threshold_values({k: v for k, v in options.items() if k in declared}).items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        return f"WatchConfig({', '.join(f'{name}={getattr(self, name)!r}' for name in self.names())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option, the signal thresholds after ``store``."""
        own = [f.name for f in fields(_Options)]
        at = own.index("store") + 1
        return (*own[:at], *_threshold_names(), *own[at:])

    @classmethod
    def signature(cls) -> inspect.Signature:
        """``(run=None, *, port=9400, ...)``: every option with its default (``Watch.__init__``'s signature)."""
        types = {f.name: f.type for f in fields(_Options)}
        default = cls()
        return inspect.Signature([inspect.Parameter(
            name, inspect.Parameter.POSITIONAL_OR_KEYWORD if name == "run" else inspect.Parameter.KEYWORD_ONLY,
            default=getattr(default, name), annotation=types.get(name, type(getattr(default, name)).__name__))
            for name in cls.names()])

    def thresholds(self) -> dict[str, Any]:
        """The signal thresholds' values by name."""
        return {name: getattr(self, name) for name in _threshold_names()}

    def signal_config(self) -> Any:
        """The :class:`~rlwatch.signals.SignalConfig` of these options."""
        from ..signals.signal_config import SignalConfig

        return SignalConfig(**self.thresholds(), reward_bounds=self.reward_bounds, group_size=self.group_size)

    def store_file(self, run: str) -> str | None:
        """The run store's path: None (no store), the path given, or ``store_dir()/<run>.db`` for "auto"."""
        if not self.store:
            return None
        return os.path.join(store_dir(), f"{safe_filename(run)}.db") if self.store == "auto" else self.store

    def discovery_dir(self) -> str | bool | None:
        """The file_sd directory to register in: the option, else $RLWATCH_SD_DIR; False when the one
        that applies is empty (no registration); None when neither is set (a local stack's, if any)."""
        chosen = self.sd_dir if self.sd_dir is not None else _get("RLWATCH_SD_DIR")
        return None if chosen is None else (chosen or False)


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job (from the launcher's variables, :func:`rank`): its global
    ``rank``, ``local_rank`` and the ``world`` size; whether it exports (``active``: rank 0, or every
    rank with ``all_ranks``); its ``run`` name (``<run>-rank<N>`` when every rank of a job of several
    exports); and the offset added to its port (the local rank with ``all_ranks``, else 0)."""

    rank: int
    local_rank: int
    world: int
    active: bool
    run: str
    port_offset: int


def placement(run: str | None, all_ranks: bool) -> Placement:
    """The :class:`Placement` of a Watch with these ``run`` and ``all_ranks`` options."""
    from .record import clean_text

    global_rank, local, world = rank()
    base = clean_text(run or default_run_name())     # $RLWATCH_RUN may hold surrogate escapes
    return Placement(global_rank, local, world, active=global_rank == 0 or all_ranks,
                     run=f"{base}-rank{global_rank}" if all_ranks and world > 1 else base,
                     port_offset=local if all_ranks else 0)

# --- reading the environment -----------------------------------------------------------------------

def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    return _env(environ).get(name)


def env_flag(environ: Mapping[str, str] | None, name: str, default: bool) -> bool:
    """A yes/no variable: unset or empty = ``default``; 0/false/no/off = False; anything else True."""
    value = _env(environ).get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def env_watch_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``Watch`` keyword arguments from the RLWATCH_* variables that every delivery path shares:
    RLWATCH_RUN, RLWATCH_PORT (``none``/``off``/``-1``: no endpoint), RLWATCH_ADDR,
    RLWATCH_PORT_FALLBACK (default on), RLWATCH_STORE (``none``/``off``/``0``: no store),
    RLWATCH_SD_DIR, RLWATCH_<THRESHOLD> (each signal threshold, e.g. RLWATCH_STALENESS_BOUND),
    RLWATCH_GROUP_SIZE, RLWATCH_STRICT."""
    env = _env(environ)
    opts: dict[str, Any] = {}
    if env.get("RLWATCH_RUN"):
        opts["run"] = env["RLWATCH_RUN"]
    port = (env.get("RLWATCH_PORT") or "").strip()
    if port:
        opts["port"] = None if port.lower() in (*_OFF, "-1") else int(port)
    if env.get("RLWATCH_ADDR"):
        opts["addr"] = env["RLWATCH_ADDR"]
    opts["port_fallback"] = env_flag(env, "RLWATCH_PORT_FALLBACK", True)
    store = (env.get("RLWATCH_STORE") or "").strip()
    if store:
        opts["store"] = None if store.lower() in (*_OFF, "0") else store
    if env.get("RLWATCH_SD_DIR"):
        opts["sd_dir"] = env["RLWATCH_SD_DIR"]
    opts.update(_env_thresholds(env))
    if env.get("RLWATCH_GROUP_SIZE"):
        opts["group_size"] = int(env["RLWATCH_GROUP_SIZE"])
    opts["strict"] = env_flag(env, "RLWATCH_STRICT", False)
    return opts


def _threshold_names() -> tuple[str, ...]:
    from ..signals.quantities import SIGNAL_THRESHOLDS

    return tuple(t.name for t in SIGNAL_THRESHOLDS)


def _env_thresholds(env: Mapping[str, str]) -> dict[str, Any]:
    """The signal thresholds set by RLWATCH_<NAME> (a band: ``low,high``), checked against their ranges:
    ValueError naming the variable."""
    from ..signals.quantities import SIGNAL_THRESHOLDS

    opts: dict[str, Any] = {}
    for t in SIGNAL_THRESHOLDS:
        variable = PREFIX + t.name.upper()
        text = (env.get(variable) or "").strip()
        if text:
            try:
                opts[t.name] = t.check(tuple(float(x) for x in text.split(",")) if t.parts else float(text))
            except ValueError as exc:
                raise ValueError(f"{variable}={text!r}: {exc}") from None
    return opts


def default_run_name() -> str:
    """$RLWATCH_RUN, else ``run-YYYYmmdd-HHMMSS``."""
    return _get("RLWATCH_RUN") or time.strftime("run-%Y%m%d-%H%M%S")


_last_instance_millis = 0


def run_instance() -> str:
    """This process's ``run_instance`` label: $RLWATCH_RUN_INSTANCE, else ``<host>-<pid>-<start>`` (the
    start in milliseconds, base 36), which tells apart two processes that export one run name. A Watch
    that finds a live process of its run registered under the same one in its file_sd directory
    exports ``<given>@<host>-<pid>-<start>`` instead (:func:`rlwatch.hook.lifecycle.unique_run_instance`)."""
    explicit = _get("RLWATCH_RUN_INSTANCE")
    if explicit:
        return explicit
    import re
    import socket

    global _last_instance_millis
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:32] or "host"
    # Strictly increasing within the process, so two Watches of one process differ too.
    millis = _last_instance_millis = max(int(time.time() * 1000), _last_instance_millis + 1)
    digits = ""
    while millis:
        millis, digit = divmod(millis, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
    return f"{host}-{os.getpid()}-{digits}"


def store_dir() -> str:
    """Directory of the automatic run stores: $RLWATCH_DIR, else ./rlwatch-runs."""
    return _get("RLWATCH_DIR") or DEFAULT_STORE_DIR


def safe_filename(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:120] or "run"


def rank() -> tuple[int, int, int]:
    """(global rank, local rank, world size) from the usual launcher variables."""
    def env_int(*names: str, default: int) -> int:
        for name in names:
            value = _get(name)
            if value not in (None, ""):
                try:
                    return int(value)
                except ValueError:
                    pass
        return default
    global_rank = env_int("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", default=0)
    local = env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", default=global_rank)
    world = env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", default=1)
    return global_rank, local, world


def disabled(environ: Mapping[str, str] | None = None) -> bool:
    """RLWATCH_DISABLE: the Ray worker setup hook does nothing."""
    return env_flag(environ, "RLWATCH_DISABLE", False)


def trainer_logs_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """RLWATCH_TRAINER_LOGS: unset or anything but 0/false/no/off means on."""
    return env_flag(environ, "RLWATCH_TRAINER_LOGS", True)


def frameworks(default: list[str] | tuple[str, ...]) -> set[str]:
    """RLWATCH_FRAMEWORKS as a set of names (default: ``default``)."""
    return {f.strip() for f in (_get("RLWATCH_FRAMEWORKS") or ",".join(default)).split(",") if f}


REPORT_VARIABLE = "RLWATCH_RUN_REPORT"


def run_report_path() -> str | None:
    """RLWATCH_RUN_REPORT: the file ``rlwatch run`` reads what the delivered hooks watch from."""
    return _get(REPORT_VARIABLE) or None


def rlwatch_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every RLWATCH_* variable, to hand to processes started elsewhere (Ray workers)."""
    return {key: value for key, value in _env(environ).items() if key.startswith(PREFIX)}


def variables_or_defaults(defaults: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each of ``defaults``' variables as the environment sets it, else its default (another framework's
    variables handed on to its workers, e.g. OpenRLHF's)."""
    env = _env(environ)
    return {key: env.get(key, default) for key, default in defaults.items()}


def state_dir() -> Path:
    """Where running stacks are listed: $RLWATCH_STATE_DIR, else $XDG_STATE_HOME/rlwatch, else
    ~/.local/state/rlwatch."""
    explicit = _get("RLWATCH_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = _get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "rlwatch"


RUNBOOK_URL_VARIABLE = "RLWATCH_RUNBOOK_URL"


def runbook_url(explicit: str | None = None, default: str = "") -> str:
    """The runbook's base URL: ``explicit``, else $RLWATCH_RUNBOOK_URL, else ``default``."""
    return (explicit or _get(RUNBOOK_URL_VARIABLE) or default).split("#")[0]


def compile_variable() -> str | None:
    """RLWATCH_COMPILE: whether the signal engine compiles (see :func:`rlwatch.signals.engine.compile_mode`)."""
    return _get("RLWATCH_COMPILE")
