"""The package as a user installs it: the sdist and the wheel built from this tree, the wheel
installed in a fresh virtual environment outside the repository, and `rlwatch demo --no-live`,
`rlwatch up` and `rlwatch down` run from there (with the real Prometheus and Alertmanager).

The fresh environment gets torch and the other dependencies from the test interpreter's own
site-packages through a .pth file (no download, never a CUDA build); rlwatch itself comes only
from the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, need_binary

IGNORED = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
                                 ".pytest_cache", ".hypothesis", "rlwatch-runs", "rlwatch-demo", ".rlwatch-stack",
                                 ".whl", ".gl", "shared")


def shipped_files() -> set[str]:
    """What the wheel must carry under rlwatch/_data: the repository's alerts/, dashboards/*.json, examples/."""
    files = {p.relative_to(ROOT).as_posix() for d in ("alerts", "examples") for p in (ROOT / d).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    return files | {p.relative_to(ROOT).as_posix() for p in (ROOT / "dashboards").glob("*.json")}


def _build(hook: str, source: Path, out: Path) -> Path:
    """Call setuptools' PEP 517 hook in ``source`` (no isolation: the test environment's setuptools)."""
    out.mkdir(parents=True, exist_ok=True)
    code = f"import sys; from setuptools import build_meta as b; print(b.{hook}(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                            timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out / result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """sdist from a copy of this tree, then the wheel from the unpacked sdist (as pip would)."""
    base = tmp_path_factory.mktemp("dists")
    shutil.copytree(ROOT, base / "tree", ignore=IGNORED)
    sdist = _build("build_sdist", base / "tree", base / "out")
    with tarfile.open(sdist) as archive:
        archive.extractall(base / "unpacked", filter="data")
    (source,) = (base / "unpacked").iterdir()
    wheel = _build("build_wheel", source, base / "out")
    return {"sdist": sdist, "wheel": wheel}


def test_names_and_version():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "rlwatch-llm" != "rlwatch"          # "rlwatch" on PyPI is another project
    assert meta["scripts"] == {"rlwatch": "rlwatch.ops.cli:main"}
    assert "version" in meta["dynamic"]                        # one version: rlwatch.__version__


def test_wheel_ships_the_generated_files_unchanged(dists):
    sdist_names = {n.split("/", 1)[1] for n in tarfile.open(dists["sdist"]).getnames() if "/" in n}
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = set(wheel.namelist())
        data = {n[len("rlwatch/_data/"):] for n in names if n.startswith("rlwatch/_data/") and not n.endswith("/")}
        assert data == shipped_files()
        for rel in data:                                       # byte for byte the checked-in files
            assert wheel.read(f"rlwatch/_data/{rel}") == (ROOT / rel).read_bytes(), rel
        assert "rlwatch/ops/_bootstrap/sitecustomize.py" in names
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = wheel.read(meta).decode()
        entry_points = wheel.read(meta.replace("METADATA", "entry_points.txt")).decode()
    assert shipped_files() <= sdist_names and "setup.py" in sdist_names
    assert "Name: rlwatch-llm" in metadata and "rlwatch = rlwatch.ops.cli:main" in entry_points
    import rlwatch

    assert f"Version: {rlwatch.__version__}" in metadata


@pytest.fixture(scope="module")
def venv(dists, tmp_path_factory) -> Path:
    """A fresh virtual environment outside the repository with only the wheel installed from rlwatch."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies (torch, prometheus_client, ...) from this interpreter, after the venv's own packages.
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "_rlwatch_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    result = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                             "--disable-pip-version-check", str(dists["wheel"])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return env_dir


def in_venv(venv: Path, *args: str, cwd: Path, env: dict | None = None, timeout: float = 300
            ) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    clean["PATH"] = f"{venv / 'bin'}{os.pathsep}{clean.get('PATH', '')}"
    clean.update(env or {})
    return subprocess.run(list(args), cwd=cwd, env=clean, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_installed_wheel_works_outside_the_repository(venv, tmp_path):
    work = tmp_path / "user"
    work.mkdir()
    probe = in_venv(venv, "python", "-c", "import rlwatch, rlwatch.runs.resources as r; print(rlwatch.__file__); "
                    "print(r.root()); print(len(r.dashboards()))", cwd=work)
    assert probe.returncode == 0, probe.stderr
    module, data_root, n_dashboards = probe.stdout.split()
    assert module.startswith(str(venv)) and data_root.startswith(str(venv)) and data_root.endswith("_data")
    assert int(n_dashboards) == 2
    version = in_venv(venv, "rlwatch", "--version", cwd=work)
    assert version.returncode == 0 and version.stdout.startswith("rlwatch-llm ") and str(venv) in version.stdout
    copied = in_venv(venv, "rlwatch", "files", "--copy", "kit", cwd=work)
    assert copied.returncode == 0, copied.stderr
    assert (work / "kit" / "examples" / "deploy" / "docker-compose.yml").exists()
    assert (work / "kit" / "alerts" / "runbook.md").read_text() == (ROOT / "alerts" / "runbook.md").read_text()

    demo = in_venv(venv, "rlwatch", "demo", "--no-live", "--port", str(free_port()), "--out", "demo", cwd=work,
                   timeout=400)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "The critical alert" in demo.stdout and "Cause: stale_weights." in demo.stdout
    assert list((work / "demo").glob("*/report/postmortem.json"))


@pytest.mark.servers
def test_installed_wheel_runs_the_stack_and_stops_it_from_elsewhere(venv, tmp_path):
    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    work, elsewhere = tmp_path / "user", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    state = {"RLWATCH_STATE_DIR": str(tmp_path / "state")}
    prom_port, am_port, runbook_port = free_port(), free_port(), free_port()
    up = in_venv(venv, "rlwatch", "up", "--prometheus-port", str(prom_port), "--alertmanager-port", str(am_port),
                 "--runbook-port", str(runbook_port), "--target", "127.0.0.1:1", cwd=work, env=state, timeout=120)
    stack = work / ".rlwatch-stack"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"runbook       http://127.0.0.1:{runbook_port}/" in up.stdout        # the stack's own server
        rules = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/rules", timeout=5).read())
        kl = [r for g in rules["data"]["groups"] for r in g["rules"] if r["name"] == "RLWatchKLSpike"]
        assert kl and kl[0]["annotations"]["runbook_url"] == f"http://127.0.0.1:{runbook_port}/#rlwatchklspike"
        assert (stack / "runbook.md").read_text() == (ROOT / "alerts" / "runbook.md").read_text()
        # Grafana's provisioning from the installed package (no grafana-server needed to check it)
        prov = in_venv(venv, "python", "-c", "from rlwatch.runs.stack import StackConfig, _grafana_provisioning; "
                       "_grafana_provisioning(StackConfig('g'))", cwd=work)
        assert prov.returncode == 0, prov.stderr
        assert sorted(p.name for p in (work / "g" / "grafana" / "dashboards").iterdir()) == \
            ["rlwatch-details.json", "rlwatch-overview.json"]
        pids = [info["pid"] for info in json.loads((stack / "pids.json").read_text()).values()]
        down = in_venv(venv, "rlwatch", "down", cwd=elsewhere, env=state, timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "prometheus" in down.stdout and str(stack) in down.stdout
        time.sleep(0.3)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        from rlwatch.runs.stack import down as stop

        stop(stack)
