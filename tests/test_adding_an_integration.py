"""Issue 40, item 3: an integration is added as a package alone (CONTRIBUTING, "Where a change goes").

A third-party package on ``sys.path`` that registers an ``Autoload`` through the
``rlwatch.integrations`` entry-point group is attached by ``rlwatch run`` with nothing in rlwatch
edited: its framework is listed, set up when the program imports it, selected by
``--frameworks`` (RLWATCH_FRAMEWORKS), and the Watch it announces is reported. A built-in one is a
subpackage of ``rlwatch.integrations`` with an ``AUTOLOAD``, found by iterating the package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: The framework: a module the program imports, and its distribution's metadata (what is "installed").
FRAMEWORK = {
    "fakefw/__init__.py": "",
    "fakefw/trainer.py": "class Trainer:\n    pass\n",
    "fakefw-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakefw\nVersion: 1.0\n",
}

#: The integration: one package, registered through the entry-point group, nothing else.
INTEGRATION = {
    "rlwatch_fakefw/__init__.py": textwrap.dedent('''
        from types import SimpleNamespace

        from rlwatch.integrations.registry import Autoload, announce


        def attach(module):
            module.Trainer.rlwatch_attached = True
            announce(SimpleNamespace(run="plugged", url=None, store_path=None), "fakefw")


        AUTOLOAD = Autoload(framework="fakefw", setup=attach, on_import="fakefw.trainer")
    '''),
    "rlwatch_fakefw-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: rlwatch-fakefw\nVersion: 0.1\n",
    "rlwatch_fakefw-0.1.dist-info/entry_points.txt": "[rlwatch.integrations]\nfakefw = rlwatch_fakefw:AUTOLOAD\n",
}

PROGRAM = textwrap.dedent("""
    import json, sys
    import fakefw.trainer
    print(json.dumps(dict(attached=getattr(fakefw.trainer.Trainer, "rlwatch_attached", False),
                          torch="torch" in sys.modules)))
""")


def write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)


def rlwatch_run(path: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "rlwatch", "run", "--port", "0", "--store", "none", *options, "--",
                           sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, cwd=path,
                          timeout=300)


@pytest.fixture
def plugged(tmp_path) -> Path:
    write(tmp_path, FRAMEWORK)
    write(tmp_path, INTEGRATION)
    return tmp_path


def test_rlwatch_run_attaches_an_integration_registered_through_the_entry_point_group(plugged):
    result = rlwatch_run(plugged)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["attached"]
    # Listed after the built-ins, announced while the program runs, reported at the end.
    assert "rlwatch run: watching supported trainers (trl,verl,openrlhf,fakefw)" in result.stderr
    assert "rlwatch: watching fakefw run 'plugged'" in result.stderr
    assert "rlwatch run: watched fakefw run 'plugged'" in result.stderr
    # Setting up every registered integration at start-up imported no framework's heavy dependencies.
    assert not info["torch"]


def test_frameworks_selects_it_like_a_built_in(plugged):
    left_out = rlwatch_run(plugged, "--frameworks", "trl")
    assert left_out.returncode == 0, left_out.stderr[-3000:]
    assert not json.loads(left_out.stdout.strip().splitlines()[-1])["attached"]
    chosen = rlwatch_run(plugged, "--frameworks", "fakefw")
    assert json.loads(chosen.stdout.strip().splitlines()[-1])["attached"], chosen.stderr[-3000:]


def test_without_the_package_nothing_is_attached(tmp_path):
    write(tmp_path, FRAMEWORK)
    result = rlwatch_run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not json.loads(result.stdout.strip().splitlines()[-1])["attached"]
    assert "rlwatch run: watching supported trainers (trl,verl,openrlhf)" in result.stderr


def test_a_built_in_integration_is_a_subpackage_found_by_iterating_the_package(tmp_path, monkeypatch):
    import rlwatch.integrations as integrations
    from rlwatch.integrations import registry

    write(tmp_path, {"zzfw/__init__.py": "from rlwatch.integrations.registry import Autoload\n\n"
                                         "AUTOLOAD = Autoload(framework='zzfw', setup=lambda: None)\n"})
    monkeypatch.setattr(integrations, "__path__", [*integrations.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "rlwatch.integrations.zzfw", raising=False)
    assert registry.names()[:3] == ["trl", "verl", "openrlhf"] and registry.names()[-1] == "zzfw"
    assert registry.registration("zzfw").framework == "zzfw"
    assert registry.registration("trl").on_import == "trl.trainer.grpo_trainer"
    monkeypatch.delitem(sys.modules, "rlwatch.integrations.zzfw", raising=False)
