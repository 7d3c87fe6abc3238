"""The package's layers: each subpackage imports only the layers below it (every import, lazy ones and
those under ``TYPE_CHECKING`` included), and the signals import nothing else from rlwatch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlwatch"

#: Bottom to top. A subpackage may import its own layer's packages and the layers below, never above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("signals",),                              # plain tensors in, values out
    ("core",),                                 # the step's data, the catalogue, options, errors, state
    ("alerts", "analyses", "hacks"),           # what reads the values: alert catalogue, drift, diagnosis, hacks
    ("runs",),                                 # the run store, registration, the local stack
    ("exporters",),                            # Prometheus, OpenTelemetry, push, landing page
    ("hook",),                                 # Watch, compute, the step pipeline and lifecycle
    ("postmortem", "whatif", "demo", "replay"),  # the commands beside the hook
    ("integrations",),                         # TRL, verl, OpenRLHF
    ("ops",),                                  # the command line, autoload, the child process
)
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def imports(path: Path) -> list[str]:
    """Every rlwatch module or package ``path`` imports (``from .x import y`` names ``x.y`` too)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = list(parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "rlwatch"]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.split(".")[0] == "rlwatch":
                out.append(module)
    return out


def subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


def test_the_layers_name_every_subpackage():
    found = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert found == set(LAYER)


def test_signals_import_nothing_else_from_rlwatch():
    outside = {(str(p.relative_to(PACKAGE)), m) for p in (PACKAGE / "signals").rglob("*.py")
               for m in imports(p) if subpackage(m) != "signals"}
    assert outside == set()


def test_every_import_points_down_or_across():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        here = subpackage(".".join(path.relative_to(PACKAGE.parent).parts))
        if here is None:
            continue                            # rlwatch/__init__.py and __main__.py sit above every layer
        for module in imports(path):
            there = subpackage(module)
            if there is not None and LAYER[there] > LAYER[here]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert upward == []


def test_nothing_inside_imports_the_package_root():
    """``rlwatch/__init__.py`` sits above every layer and imports lazily from them (``Watch``, the version
    check in ``ops.distribution``): a module inside that imported the root back (``from .. import
    __version__``, ``from .. import Watch``) would close a circle through it. The version is
    ``rlwatch._version``; the hook's names are imported from their own modules."""
    root = [f"{path.relative_to(PACKAGE)}" for path in PACKAGE.rglob("*.py")
            if path.parent != PACKAGE and "rlwatch" in imports(path)]
    assert root == []


def test_the_subpackages_import_each_other_in_no_circle():
    """Across one layer too (``demo`` and ``postmortem``): no subpackage reaches itself through others'
    imports (the post-mortem's checkpoint loaders are registered by whoever provides them)."""
    edges: dict[str, set[str]] = {name: set() for name in LAYER}
    for path in PACKAGE.rglob("*.py"):
        here = subpackage(".".join(path.relative_to(PACKAGE.parent).parts))
        for module in imports(path) if here is not None else ():
            there = subpackage(module)
            if there is not None and there != here:
                edges[here].add(there)

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(edges[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += edges[name]
        return seen
    assert [name for name in LAYER if name in reaches(name)] == []


def test_the_public_names_stay_where_users_import_them():
    """The restructuring moved modules, not the names users write: ``rlwatch.X`` for the hook's types, the
    integrations' packages, ``python -m rlwatch`` as the ``rlwatch`` command."""
    import importlib
    import subprocess
    import sys

    import rlwatch

    for name in rlwatch.__all__:
        assert getattr(rlwatch, name) is not None
    assert rlwatch.Watch.__module__ == "rlwatch.hook.watch" and callable(rlwatch.compute)
    for module in ("rlwatch.integrations.trl", "rlwatch.integrations.verl", "rlwatch.integrations.openrlhf",
                   "rlwatch.hacks", "rlwatch.postmortem.probe"):
        assert importlib.util.find_spec(module) is not None
    out = subprocess.run([sys.executable, "-m", "rlwatch", "--version"], capture_output=True, text=True, timeout=60,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0 and out.stdout.startswith("rlwatch-llm ")


def test_the_worker_setup_hooks_load_no_torch():
    """A Ray worker's setup hook (verl, OpenRLHF) runs before the framework chose its device: it, and the
    rollout clock the integrations import, load no torch (OpenRLHF's own test checks it in its
    environment; this one in every run)."""
    import subprocess
    import sys

    code = ("import sys, logging; logging.disable(logging.CRITICAL); import rlwatch.core.rollout, "
            "rlwatch.integrations.openrlhf as ro, rlwatch.integrations.verl as rv; "
            "ro.setup_hook(); rv.setup_hook(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0 and out.stdout.split()[-1] == "False", (out.stdout, out.stderr)
