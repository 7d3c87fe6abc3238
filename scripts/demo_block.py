#!/usr/bin/env python3
"""The demo's figures in the documentation, generated so that they cannot go stale.

Every file of :data:`FILES` carries one marked block::

    <!-- demo:begin ... -->
    ...
    <!-- demo:end -->

holding what ``rlwatch demo --no-live`` printed: its alert transitions (FIRING / RESOLVED lines; in
docs/results.md) and its closing lines (the headline, the cause, where to resume), with the run's directory written as
``rlwatch-demo/collapse-<time>``. ``--write`` runs the demo (about 10 s of training on CPU) and
rewrites the blocks; ``--check`` runs it and exits 1, naming the file, when a block differs
(``make check`` runs it). ``--from FILE`` reads a saved demo output instead of running the demo.

    python scripts/demo_block.py --write      # after a change to the demo or the post-mortem
    python scripts/demo_block.py --check
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The files whose demo block is generated, relative to the repository root, and whether the block
#: carries the alert transitions too (True) or only the closing lines.
FILES = {"README.md": False, "docs/results.md": True}
BEGIN = "<!-- demo:begin"
END = "<!-- demo:end -->"
COMMAND = "rlwatch demo --no-live"
HEADER = (f"{BEGIN} (generated from `{COMMAND}` by `python scripts/demo_block.py --write`; "
          f"`make check` verifies it) -->")
_TRANSITION = re.compile(r"^step \d+: (FIRING|RESOLVED) ")
_RUN_DIR = re.compile(r"(?:/|\b)[^\s()]*?(collapse|healthy|rescued|hack|temperature_fault|top_p_fault)-\d{8}-\d{6}")


def run_demo() -> str:
    """What ``rlwatch demo --no-live`` prints (stdout), run from a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="rlwatch-demo-block-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                          if p))
        result = subprocess.run([sys.executable, "-m", "rlwatch", "demo", "--no-live", "--port", "0",
                                 "--out", str(Path(tmp) / "rlwatch-demo")], capture_output=True, text=True,
                                env=env, cwd=tmp, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{COMMAND} failed ({result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result.stdout


def block(output: str, transitions: bool = True) -> str:
    """The marked block for a demo's stdout: its alert transitions (when ``transitions``), then its
    closing lines (from the first line after the post-mortem that is not blank up to the run store's
    line), the run directory made relative and timeless."""
    lines = output.splitlines()
    changes = [line for line in lines if _TRANSITION.match(line)]
    end = next((i for i, line in enumerate(lines) if line.startswith("Run store ")), None)
    if end is None:
        raise ValueError("no 'Run store ...' line: not the output of a finished demo")
    start = end
    while start > 0 and lines[start - 1].strip():
        start -= 1
    closing = lines[start:end]
    if not changes or not closing:
        raise ValueError("no alert transition or no closing line in the demo's output")
    body = [f"$ {COMMAND}", *(changes if transitions else []), "...", *closing]
    text = "\n".join(_RUN_DIR.sub(lambda m: f"rlwatch-demo/{m.group(1)}-<time>", line) for line in body)
    return f"{HEADER}\n```text\n{text}\n```\n{END}"


def replace(document: str, new_block: str, name: str = "document") -> str:
    """``document`` with its one marked block replaced by ``new_block``."""
    starts, ends = document.count(BEGIN), document.count(END)
    if starts != 1 or ends != 1:
        raise ValueError(f"{name}: expected one {BEGIN} ... {END} block, found {starts} begin and {ends} end markers")
    head, rest = document.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + new_block + tail


def stale(files: dict[str, str], output: str) -> list[str]:
    """For each file whose block differs from the one ``output`` (a demo's stdout) gives: its name and a
    diff (empty when all agree)."""
    problems = []
    for name, text in files.items():
        try:
            wanted = replace(text, block(output, FILES.get(name, True)), name)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if wanted != text:
            diff = difflib.unified_diff(text.splitlines(), wanted.splitlines(), f"{name} (checked in)",
                                        f"{name} ({COMMAND} now)", lineterm="", n=1)
            problems.append("\n".join(diff))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the blocks from a demo run")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block differs from a demo run")
    parser.add_argument("--from", dest="source", metavar="FILE", help="a saved demo stdout instead of a run")
    parser.add_argument("--root", default=str(ROOT), help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    output = Path(args.source).read_text() if args.source else run_demo()
    root = Path(args.root)
    files = {name: (root / name).read_text() for name in FILES}
    if args.write:
        for name, text in files.items():
            (root / name).write_text(replace(text, block(output, FILES[name]), name))
        print(f"demo block written to {', '.join(FILES)}")
        return 0
    problems = stale(files, output)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("the demo's figures in the documentation are stale: run `python scripts/demo_block.py --write`",
              file=sys.stderr)
        return 1
    print(f"demo block up to date in {', '.join(FILES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
