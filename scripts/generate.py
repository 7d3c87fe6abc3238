#!/usr/bin/env python3
"""Every generated file from its generator, in one command (``make generate``); ``--check`` (``make check``)
runs each generator's check and names the stale ones, with the command that rewrites them.

    python scripts/generate.py            # rewrite every generated file
    python scripts/generate.py --check    # exit 1 naming each generator whose files differ

The acceptance reports (``alerts/acceptance.md``, ``alerts/length-bias-acceptance.md``) are measurements,
not generated files: rerun them after a change to an alert's condition or a default threshold (CONTRIBUTING,
"Where a change goes").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (what it writes, the command, its write flags, its check flags), in the order they run: the alert files
#: first (the runbook the exposition links to), the demo block last (it trains the demo, ~10 s).
GENERATORS: tuple[tuple[str, list[str], list[str], list[str]], ...] = (
    ("alert rules, runbook, promtool tests, Alertmanager and overrides examples (alerts/)",
     ["-m", "rlwatch.alerts.render"], [], ["--check"]),
    ("Grafana dashboards (dashboards/*.json)", ["dashboards/generate.py"], [], ["--check"]),
    ("golden exposition (tests/data/exposition_golden.txt, .om.txt)", ["-m", "tests.test_exposition_golden"],
     [], ["--check"]),
    ("demo block (README.md, docs/results.md)", ["scripts/demo_block.py"], ["--write"], ["--check"]),
    ("replay example (docs/replay.md)", ["scripts/replay_example.py"], ["--write"], ["--check"]),
    ("real-run figures (docs/real-runs.md)", ["-m", "evaluation.realruns"], ["--write-doc"], ["--check-doc"]),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="name the stale generated files; rewrite nothing")
    args = parser.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    stale = []
    for what, command, write, check in GENERATORS:
        line = [sys.executable, *command, *(check if args.check else write)]
        print(f"{'checking' if args.check else 'writing'}: {what}", flush=True)
        if subprocess.run(line, cwd=ROOT, env=env).returncode != 0:
            stale.append(f"{what}: `python {' '.join(command + write)}`")
    if stale:
        verb = "stale" if args.check else "failed"
        print(f"\n{len(stale)} generator(s) {verb} (`make generate` reruns them all):", *stale, sep="\n  ",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
