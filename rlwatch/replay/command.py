"""``rlwatch replay``'s options and what it runs (the command line itself is :mod:`rlwatch.ops.cli`)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``rlwatch replay``."""
    from .formats import FORMATS

    p.add_argument("files", nargs="+", metavar="FILE",
                   help="logged metrics: trainer_state.json, a verl console or JSONL log, an OpenRLHF log, "
                        "ms-swift's logging.jsonl, a W&B, TensorBoard or SwanLab CSV export; each file its own run "
                        "(TensorBoard per-tag CSVs, W&B chart exports of one run, SwanLab chart exports: one run)")
    p.add_argument("--run", metavar="NAME", help="the run to read from SwanLab chart exports, which hold one metric "
                   "for several runs (columns <run>-<key>_step); needed when they hold more than one")
    p.add_argument("--reward", metavar="KEY", help="the reward key, when the log's is not a recognised name")
    p.add_argument("--format", choices=FORMATS, help="the files' format (default: detected from the content)")
    p.add_argument("--override", action="append", metavar="NAME=VALUE",
                   help="an alert threshold for the replay (rlwatch.alerts.catalogue.PARAMS), repeatable")
    p.add_argument("--out", metavar="DIR", help="keep the replay's run stores here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print the post-mortem's JSON with the replay's alerts "
                   "(one document per run; a list for several)")


def _overrides(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"--override {pair!r}: expected NAME=NUMBER")
    return out


def _one(run: object, out_dir: str, overrides: dict[str, float], as_json: bool) -> dict:
    from ..postmortem.report import text_report
    from . import report
    from .run import replay

    result = replay(run, store_dir=out_dir, overrides=overrides)  # type: ignore[arg-type]
    if not as_json:
        print(report.text(result) + "\n\n" + text_report(result.report), flush=True)
    return result.as_json()


def run_command(args: argparse.Namespace) -> int:
    """``rlwatch replay``: each file replayed; the exit status (2: a file or an option replay cannot use)."""
    from ..postmortem.report import safe
    from .formats import ReplayInputError
    from .logged import load_all

    try:
        overrides = _overrides(args.override or [])
        from ..alerts.params import validate_overrides
        validate_overrides(overrides)
    except ValueError as exc:
        print(f"rlwatch replay: {safe(exc)}", file=sys.stderr)
        return 2
    status, documents = 0, []
    with tempfile.TemporaryDirectory(prefix="rlwatch-replay-") as scratch:
        runs = load_all(args.files, reward_key=args.reward, fmt=args.format, run=args.run)
        for index, run in enumerate(runs):
            if isinstance(run, ReplayInputError):
                print(f"rlwatch replay: {safe(run)}", file=sys.stderr)
                status = 2
                continue
            if index and not args.json:
                print("\n" + "=" * 100 + "\n")
            documents.append(_one(run, args.out or scratch, overrides, args.json))
    if args.json and documents:
        print(json.dumps(documents[0] if len(runs) == 1 else documents, indent=2, default=str))
    return status
