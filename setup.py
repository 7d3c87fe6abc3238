"""Only what pyproject.toml cannot say: the package data that lives outside the package.

The generated alert files (``alerts/``), the dashboards (``dashboards/*.json``) and the examples
(``examples/``) stay at the repository root, where their generators write them and ``make check``
verifies them. Building a wheel copies them into ``rlwatch/_data/`` in the same layout, so the
installed package carries exactly the checked-in files (``rlwatch.runs.resources`` reads them; an
editable install reads the repository itself).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
#: (directory, glob) pairs shipped as rlwatch/_data/<directory>/...
DATA = (("alerts", "*"), ("dashboards", "*.json"), ("examples", "**/*"))


def data_files() -> list[Path]:
    """The repository files that go into rlwatch/_data, relative to the repository root."""
    files = []
    for directory, pattern in DATA:
        for path in sorted((HERE / directory).glob(pattern)):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append(path.relative_to(HERE))
    return files


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return                              # an editable install reads the repository itself
        target = Path(self.build_lib) / "rlwatch" / "_data"
        if target.exists():
            shutil.rmtree(target)
        files = data_files()
        if not any(f.parts[0] == "dashboards" for f in files) or not (HERE / "alerts" / "runbook.md").is_file():
            raise SystemExit("rlwatch build: alerts/runbook.md or dashboards/*.json missing from the source tree")
        for rel in files:
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(HERE / rel, dest)
        # Empty directories the examples rely on (the file_sd targets directory of the compose example).
        (target / "examples" / "deploy" / "targets").mkdir(parents=True, exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithData})
