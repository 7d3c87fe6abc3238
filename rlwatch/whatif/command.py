"""``rlwatch whatif``'s options and what it runs (the command line itself is :mod:`rlwatch.ops.cli`)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``rlwatch whatif``."""
    p.add_argument("path", nargs="?", help="run store, TRL output directory or verl checkpoint directory")
    p.add_argument("--run", help="run name (stores with several runs)")
    p.add_argument("--env", help="only this environment's episode durations")
    p.add_argument("--slots", type=int, help="generation slots (default: the run's episodes per step)")
    p.add_argument("--batch-size", type=int, help="episodes per step (default: the run's)")
    p.add_argument("--train-s", type=float, help="training seconds per step (default: the run's median)")
    p.add_argument("--sync-s", type=float, help="weight-sync seconds per step (default: the run's median)")
    p.add_argument("--steps", type=int, help="steps simulated (default: the run's, within 20..200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the resampled durations")
    p.add_argument("--k3-bound", type=float, help="k3 a design may reach at its mean staleness (default: the run's "
                   "kl_k3_max alert threshold)")
    p.add_argument("--chapter", action="store_true",
                   help="instead: the reference chapter's figures, recomputed with its duration model")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run_command(args: argparse.Namespace) -> int:
    """``rlwatch whatif``: the chapter's figures (``--chapter``) or the designs on a run; the exit status."""
    if args.chapter:
        from .chapter import design_table, render, reproduce

        print(render(reproduce()) + "\n\nEvery design on the chapter's pipeline (64 slots, 64 episodes per step, "
              "60 s training, 10 s sync, 20 steps):\n" + design_table())
        return 0
    from ..postmortem.report import safe
    from . import measured, report

    if args.path is None:
        print("rlwatch whatif: give a run store, a TRL output directory or a verl checkpoint directory (or --chapter)",
              file=sys.stderr)
        return 2
    try:
        run = measured.load(args.path, run=args.run, env=args.env)
        result = report.build(run, slots=args.slots, batch_size=args.batch_size, train_s=args.train_s,
                              sync_s=args.sync_s, steps=args.steps, seed=args.seed, k3_bound=args.k3_bound)
    except FileNotFoundError as exc:
        print(f"rlwatch whatif: not found: {safe(exc.filename or exc)}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:       # no durations, an unreadable store, bad option values
        print(f"rlwatch whatif: {safe(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(report.as_json(result), indent=2) if args.json else report.render(result))
    return 0
