"""Shared fixtures: free loopback ports, real server processes stopped by PID, step records; and the
``servers`` / ``frameworks`` markers, put on every test that needs a server binary or a framework."""

from __future__ import annotations

import ast
import inspect
import os
import sys
import shutil
import signal
import socket
import subprocess
import textwrap
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# .ci/run sets this so that a missing server binary fails the suite instead of skipping it.
REQUIRE_SERVERS = os.environ.get("RLWATCH_REQUIRE_SERVERS") == "1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_consecutive_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that were all free at once. (free_port's
    next port is no such thing: the kernel hands bind(0) odd ports and connect() even ones, so the
    port after a free one is where an outgoing connection most likely sits.)"""
    for _ in range(200):
        base = free_port()
        held = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free loopback ports")


def need_binary(name: str) -> str:
    _check_marked("need_binary")
    path = shutil.which(name)
    if path is None:
        if REQUIRE_SERVERS:
            pytest.fail(f"{name} is not installed (apt-get install prometheus prometheus-alertmanager "
                        f"prometheus-pushgateway)")
        pytest.skip(f"{name} not installed")
    return path


def self_signed_cert(directory: Path) -> tuple[str, str]:
    """(certificate, key) paths of a fresh self-signed certificate for 127.0.0.1 (openssl)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``url`` answers 200; give up early when ``proc`` (the server) has exited."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except Exception as exc:  # noqa: BLE001
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready: {last}")


@dataclass
class ServerProcess:
    """A real server binary on 127.0.0.1, stopped by its PID."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_process(args: list[str], port: int, log: Path, ready_path: str = "/-/ready") -> ServerProcess:
    handle = open(log, "wb")
    proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, port, log)
    try:
        wait_http(server.url + ready_path, proc=proc)
    except Exception as exc:
        server.stop()
        raise RuntimeError(f"{args[0]} did not start ({exc}):\n{server.output()}") from exc
    return server


@pytest.fixture
def pushgateway(tmp_path: Path):
    binary = need_binary("prometheus-pushgateway")
    port = free_port()
    # --persistence.file=: in memory (Debian's default file is shared by every gateway on the machine)
    server = start_process([binary, f"--web.listen-address=127.0.0.1:{port}", "--persistence.file="], port,
                           tmp_path / "pushgateway.log")
    yield server
    server.stop()


def make_step(B: int = 16, T: int = 32, seed: int = 0, lag_max: int = 4, noise: float = 0.1,
              envs: tuple[str, ...] = ("math", "code"), group: int = 4) -> dict:
    """A random but well-formed step record (right-padded responses)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    sampler = -torch.rand(B, T, generator=g) * 3
    trainer = sampler + noise * torch.randn(B, T, generator=g)
    version = 10 - torch.randint(0, lag_max + 1, (B, 1), generator=g).expand(B, T).clone()
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    return dict(mask=mask, sampler_logp=sampler, trainer_logp=trainer, token_version=version, trainer_version=10,
                rewards=rewards, group_ids=torch.arange(B) // group, truncated=lengths == T,
                env=[envs[i % len(envs)] for i in range(B)])


def observe_timed(watch, steps: int = 20, pause: float = 0.05) -> list[float]:
    """Seconds each of ``steps`` ``observe`` calls took (step ``i`` is ``make_step(seed=i)``, ``pause`` s apart)."""
    durations = []
    for step in range(steps):
        start = time.perf_counter()
        watch.observe(step, **make_step(seed=step))
        durations.append(time.perf_counter() - start)
        time.sleep(pause)
    return durations


class TrickleHandler(BaseHTTPRequestHandler):
    """A receiver that reads a POST, then sends ``answer`` one byte every 0.2 s; ``posts`` counts the
    POSTs (per subclass)."""

    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    posts = 0

    def do_POST(self):  # noqa: N802
        type(self).posts += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        for byte in self.answer:
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)

    def log_message(self, *args):
        pass



@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A tiny random Qwen2 saved offline, for the TRL tests (tests/test_trl_*.py): one per test module."""
    from ._trl_tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def config():
    """verl's ppo_trainer.yaml composed with Hydra, for the verl tests (tests/test_verl_*.py)."""
    from ._verl_helpers import compose_config

    need_module("verl")
    need_module("hydra")
    return compose_config()


@pytest.fixture
def instrumented(tmp_path):
    """verl instrumented in this process, reporting to a strict Watch with a run store."""
    from rlwatch import Watch
    from rlwatch.integrations import verl as rv

    from ._verl_helpers import N

    watch = Watch(run="verl-test", port=None, store=str(tmp_path / "run.db"), strict=True, group_size=N,
                  alerts=False)
    assert rv.instrument(watch=watch)
    yield rv.INSTRUMENTOR, watch
    rv.uninstrument()
    watch.close()

REQUIRE_FRAMEWORKS = os.environ.get("RLWATCH_REQUIRE_FRAMEWORKS") == "1"


def need_module(name: str):
    """Import a framework package; fail (under .ci/run) or skip (elsewhere) when it is missing."""
    import importlib

    _check_marked("need_module")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if REQUIRE_FRAMEWORKS:
            pytest.fail(f"{name} is required here: {exc}")
        pytest.skip(f"{name} not installed: {exc}", allow_module_level=True)   # also at a module's top


@pytest.fixture(autouse=True, scope="session")
def _private_state_dir(tmp_path_factory):
    """Stacks the tests start are listed in a state directory of their own (their subprocesses inherit
    it), so that a developer's running `rlwatch up` is invisible to them: no test Watch registers with it."""
    saved = os.environ.get("RLWATCH_STATE_DIR")
    os.environ["RLWATCH_STATE_DIR"] = str(tmp_path_factory.mktemp("rlwatch-state"))
    yield
    if saved is None:
        os.environ.pop("RLWATCH_STATE_DIR", None)
    else:
        os.environ["RLWATCH_STATE_DIR"] = saved


@pytest.fixture(autouse=True)
def _memory_log(request):
    """With RLWATCH_MEMLOG=<file>, append each test's resident memory after it ran (diagnostics)."""
    yield
    path = os.environ.get("RLWATCH_MEMLOG")
    if path:
        with open("/proc/self/status") as f:
            rss = next((line.split()[1] for line in f if line.startswith("VmRSS:")), "?")
        with open(path, "a") as out:
            out.write(f"{rss} kB {request.node.nodeid}\n")


# --- markers: what a test needs, read from what it calls ----------------------------------------------
# A test is marked ``servers`` when it, a fixture it uses or a function of its module it calls
# (transitively) calls need_binary, and ``frameworks`` likewise for need_module; a module that calls
# need_module at import marks all its tests. ``make check`` deselects both. A call the reading misses
# fails the test (_check_marked), so that the markers stay true under ``make test``.
NEEDS = {"need_binary": "servers", "need_module": "frameworks"}
_running: list[pytest.Item] = []


def _calls(tree: ast.AST, skip_definitions: bool = False) -> set[str]:
    """Names of the functions called in ``tree`` (``f(...)`` and ``x.f(...)``)."""
    nodes = ast.iter_child_nodes(tree) if skip_definitions else [tree]
    names: set[str] = set()
    for top in nodes:
        if skip_definitions and isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(top):
            if isinstance(node, ast.Call):
                func = node.func
                names.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return names


def _module_needs(module) -> tuple[set[str], dict[str, set[str]]]:
    """What ``module`` needs at import, and what each of its top-level functions needs (transitively)."""
    cached = getattr(module, "__rlwatch_needs__", None)
    if cached is not None:
        return cached
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set(), {}
    functions = {node.name: _calls(node) for node in tree.body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    needs = {name: {NEEDS[c] for c in calls if c in NEEDS} for name, calls in functions.items()}
    changed = True
    while changed:                       # a function needs what the functions it calls need
        changed = False
        for name, calls in functions.items():
            more = set().union(*(needs[c] for c in calls if c in needs and c != name)) - needs[name]
            if more:
                needs[name] |= more
                changed = True
    at_import = {NEEDS[c] for c in _calls(tree, skip_definitions=True) if c in NEEDS}
    module.__rlwatch_needs__ = (at_import, needs)
    return at_import, needs


def _function_needs(func) -> set[str]:
    """What a test or fixture function needs: its own calls and those of its module's functions it calls."""
    func = inspect.unwrap(func)
    by_function = _module_needs(inspect.getmodule(func))[1]
    if "<locals>" not in func.__qualname__ and func.__name__ in by_function:
        return set(by_function[func.__name__])
    try:
        calls = _calls(ast.parse(textwrap.dedent(inspect.getsource(func))))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {NEEDS[c] for c in calls if c in NEEDS}.union(*(by_function[c] for c in calls if c in by_function))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        needs = set(_module_needs(item.module)[0]) | _function_needs(function)
        fixtures = getattr(item, "_fixtureinfo", None)
        for defs in (fixtures.name2fixturedefs.values() if fixtures is not None else ()):
            for fixturedef in defs:
                if inspect.isfunction(getattr(fixturedef, "func", None)):
                    needs |= _function_needs(fixturedef.func)
        for marker in sorted(needs):
            item.add_marker(marker)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _running[:] = [item]


def _check_marked(helper: str) -> None:
    if _running and _running[0].get_closest_marker(NEEDS[helper]) is None:
        pytest.fail(f"{_running[0].nodeid} calls {helper} but is not marked {NEEDS[helper]}: mark it "
                    f"(@pytest.mark.{NEEDS[helper]}), since `make check` selects tests by these markers")


def host_reads(monkeypatch) -> list[str]:
    """Spies on every tensor method that reads a value to the host (``item``, ``tolist``, ``cpu``, ...): the
    returned list collects their names as they are called, until ``monkeypatch.undo()``."""
    calls: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, __name=name, __original=original, **kwargs):
            calls.append(__name)
            return __original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


def patch_catalogue(monkeypatch, specs: tuple) -> None:
    """Add catalogue entries ``specs`` for one test: in every rlwatch module that holds the catalogue
    (rlwatch.core.metrics itself among them) and in its index by name."""
    from rlwatch.core import metrics

    catalogue = metrics.CATALOGUE
    for module in [m for name, m in sys.modules.items() if name.startswith("rlwatch")]:
        if getattr(module, "CATALOGUE", None) is catalogue:
            monkeypatch.setattr(module, "CATALOGUE", catalogue + specs)
    for spec in specs:
        monkeypatch.setitem(metrics.BY_NAME, spec.name, spec)
