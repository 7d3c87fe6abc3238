"""``rlwatch whatif``'s options and what it runs (the command line itself is :mod:`rlwatch.ops.cli`)."""

from __future__ import annotations

import argparse
import json
import math
import sys

#: The largest count (slots, episodes per step, steps) a flag may ask for; the simulation is bounded
#: again as a whole by :data:`rlwatch.whatif.report.MAX_EPISODES`.
MAX_COUNT = 1_000_000
#: The longest training step or weight sync a flag may ask for: one week, in seconds.
MAX_PHASE_S = 7 * 24 * 3600.0


def _number(text: str) -> float:
    """A flag's number as written (``64``, ``1e3``, ``nan``); its range is checked by :func:`check_options`."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def check_options(args: argparse.Namespace) -> str | None:
    """The first option out of range, as one line (None when every option is usable): counts are
    whole numbers in 1..MAX_COUNT, seconds finite within 0..MAX_PHASE_S, the k3 bound finite and positive."""
    for flag, value in (("--slots", args.slots), ("--batch-size", args.batch_size), ("--steps", args.steps)):
        if value is not None and not (math.isfinite(value) and value == int(value) and 1 <= value <= MAX_COUNT):
            return f"{flag} {value:g}: give a whole number from 1 to {MAX_COUNT:,}"
    for flag, value in (("--train-s", args.train_s), ("--sync-s", args.sync_s)):
        if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_PHASE_S):
            return f"{flag} {value:g}: give seconds from 0 to {MAX_PHASE_S:,.0f} (one week)"
    if args.k3_bound is not None and not (math.isfinite(args.k3_bound) and args.k3_bound > 0):
        return f"--k3-bound {args.k3_bound:g}: give a positive number"
    return None


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``rlwatch whatif``."""
    p.add_argument("path", nargs="?", help="run store, TRL output directory or verl checkpoint directory")
    p.add_argument("--run", help="run name (stores with several runs)")
    p.add_argument("--env", help="only this environment's episode durations")
    p.add_argument("--slots", type=_number, help="generation slots (default: the run's episodes per step)")
    p.add_argument("--batch-size", type=_number, help="episodes per step (default: the run's)")
    p.add_argument("--train-s", type=_number, help="training seconds per step (default: the run's median)")
    p.add_argument("--sync-s", type=_number, help="weight-sync seconds per step (default: the run's median)")
    p.add_argument("--steps", type=_number, help="steps simulated (default: the run's, within 20..200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the resampled durations")
    p.add_argument("--k3-bound", type=_number, help="k3 a design may reach at its mean staleness (default: the run's "
                   "kl_k3_max alert threshold)")
    p.add_argument("--chapter", action="store_true",
                   help="instead: the figures of chapter 13 of the Agent RL tutorial ('Rollout Systems and Off-Policy "
                        "Correction', agent-rl.tacetai.com), recomputed with its duration model")
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
    problem = check_options(args)
    if problem:
        print(f"rlwatch whatif: {problem}", file=sys.stderr)
        return 2
    try:
        run = measured.load(args.path, run=args.run, env=args.env)
        result = report.build(run, slots=_count(args.slots), batch_size=_count(args.batch_size), train_s=args.train_s,
                              sync_s=args.sync_s, steps=_count(args.steps), seed=args.seed, k3_bound=args.k3_bound)
    except report.TooLarge as exc:             # steps x episodes per step beyond what is simulated
        print(f"rlwatch whatif: {safe(exc)}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"rlwatch whatif: not found: {safe(exc.filename or exc)}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:       # no durations, an unreadable store, bad option values
        print(f"rlwatch whatif: {safe(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(report.as_json(result), indent=2) if args.json else report.render(result))
    return 0
