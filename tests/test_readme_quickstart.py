"""The README's Quick start runs as written after `make demo`: every script it names exists, and the
TRL example comes after the one command that installs what it imports (`make demo` installs `[report]`
only: no TRL, no datasets)."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

from tests.conftest import ROOT


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_every_script_the_quick_start_runs_exists():
    scripts = [m for line in _quick_start_commands() for m in re.findall(r"python (\S+\.py)", line)]
    assert scripts, "no python command in the Quick start"
    missing = [s for s in scripts if not (ROOT / s).is_file()]
    assert not missing, f"the Quick start runs scripts that do not exist: {missing}"


def test_the_trl_example_follows_the_install_of_the_trl_extra():
    commands = _quick_start_commands()
    trl = next(i for i, line in enumerate(commands) if "examples/trl_grpo.py" in line)
    assert any("pip install" in line and ".[trl]" in line for line in commands[:trl]), commands
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("trl") for r in extras["trl"])
    # The example imports datasets: TRL requires it, so the [trl] extra brings it.
    assert "from datasets import" in (ROOT / "examples" / "trl_grpo.py").read_text()
    assert any(r.split()[0].startswith("datasets") for r in importlib.metadata.requires("trl") or [])
