"""Which distribution this is, and the unrelated PyPI project that shares the import name.

rlwatch is published as ``rlwatch-llm``: the name ``rlwatch`` on PyPI belongs to an unrelated
project (versions 0.3.0-0.5.1, scalar detectors with Slack alerts) that installs a package also
named ``rlwatch``. Installed side by side, the two overwrite each other's ``rlwatch/__init__.py``,
``rlwatch/ops/cli.py`` and the ``rlwatch`` command, and uninstalling either breaks the other.
"""

from __future__ import annotations

import importlib.metadata
import os

DIST_NAME = "rlwatch-llm"
FOREIGN_DIST = "rlwatch"
#: files of the unrelated project's package (0.3-0.5.1) that rlwatch-llm never ships
FOREIGN_MARKERS = ("core.py", "detectors.py", "storage.py", "dashboard.py")
#: the start of this project's summary, which tells an old install of it under the name rlwatch apart
OUR_SUMMARY = "Per-token health signals for RL post-training"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # rlwatch/


def version() -> str:
    """The installed rlwatch-llm version (the package's own when not installed as a distribution)."""
    from .._version import __version__

    try:
        return importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return __version__


def foreign_files(package_dir: str = PACKAGE_DIR) -> list[str]:
    """Files of the unrelated ``rlwatch`` project found inside this package's directory (cheap)."""
    return [name for name in FOREIGN_MARKERS if os.path.exists(os.path.join(package_dir, name))]


def foreign_rlwatch() -> str | None:
    """``"rlwatch 0.5.1"`` when the unrelated PyPI project is installed in this environment, else None."""
    try:
        dist = importlib.metadata.distribution(FOREIGN_DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and not (dist.metadata.get("Summary") or "").startswith(OUR_SUMMARY):
        return f"{FOREIGN_DIST} {dist.version}"
    found = foreign_files()
    return f"files of another rlwatch project ({', '.join(found)})" if found else None


def conflict_message(found: str | None) -> str:
    what = found or "the unrelated PyPI project 'rlwatch'"
    return (f"{what} is installed in this environment as well as {DIST_NAME}; both use the import name "
            f"'rlwatch' and overwrite each other's files. Fix: pip uninstall -y rlwatch {DIST_NAME} && "
            f"pip install {DIST_NAME} (or keep them in separate virtual environments).")
