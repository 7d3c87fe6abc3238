"""Step-time overhead of the TRL integration on the tiny CPU GRPOTrainer of the tests.

Paired per step: every training is watched with the default one-line setup
(``rlwatch.integrations.trl.watch(trainer)``: /metrics endpoint, run store, in-process alerts), and
rlwatch's work is switched on for every other optimizer step only (which parity is on flips from one
training to the next). On an "off" step the wrappers still run but return at once, so no sample is
stamped or captured, nothing is observed and no logs are forwarded. Adjacent steps of one training
share the model size, the batch shapes and, as far as possible, the load of a shared machine, which
makes the comparison far steadier than separate trainings.

A step runs from one ``on_step_begin`` to the next: it includes what rlwatch does on the training
thread for that step (capture during generation and loss, handing the step to rlwatch's thread,
forwarded logs). The TRL hook computes each step on rlwatch's own thread (``background=True``), so
that work lands beside the following step, whichever arm it is in: the paired wall ratio then
understates it, and the CPU time of that thread per step is reported separately. The first two
steps of each training are dropped (warm-up). Reported per arm: median wall time and median process
CPU time (all threads), their ratios, the time measured inside rlwatch's hooks on the training
thread, and the CPU time of rlwatch's thread per step. ``--whole-trainings`` compares whole
trainings watched and not watched (ABBA) instead; ``--foreground`` computes on the training thread.
Run:

    PYTHONPATH=. python bench/bench_trl_overhead.py [--trainings 8] [--steps 22] [--threads N] [--no-store]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from rlwatch.integrations import trl as rltrl  # noqa: E402
from tests._trl_tiny import build_tiny_model, make_trainer  # noqa: E402

WARMUP_STEPS = 2
WATCH_OPTIONS: dict = {}
BACKGROUND = {"cpu_seconds": 0.0, "on_steps": 0}     # rlwatch's own thread (background=True)


class Switch:
    """Turns rlwatch's work on or off per step, and times it while on (bench-only class patches)."""

    METHODS = [(rltrl.GRPOInstrumentor, "_on_rewards"), (rltrl.GRPOInstrumentor, "_on_generation"),
               (rltrl.GRPOInstrumentor, "_on_loss"), (rltrl.GRPOInstrumentor, "flush"),
               (rltrl.RLWatchCallback, "on_log"), (rltrl.RLWatchCallback, "on_save")]

    def __init__(self) -> None:
        self.on = True
        self.hook_seconds = 0.0
        for owner, name in self.METHODS:
            original = getattr(owner, name)

            def switched(*args, _original=original, _name=name, **kwargs):
                if not self.on:
                    return args[3] if _name.startswith("on_") else None      # callbacks return control
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.hook_seconds += time.perf_counter() - start
            setattr(owner, name, switched)


class StepClock(TrainerCallback):
    """Flips the switch at each step begin and records (on, wall s, CPU s, hook s) per step."""

    def __init__(self, switch: Switch, first_on: bool, fixed: bool = False) -> None:
        self.switch = switch
        self.first_on = first_on
        self.fixed = fixed                  # whole-training arms: no flipping
        self.steps: list[tuple[bool, float, float, float]] = []
        self._mark: tuple[float, float, float] | None = None

    def _close_step(self) -> None:
        now = (time.perf_counter(), time.process_time(), self.switch.hook_seconds)
        if self._mark is not None:
            self.steps.append((self.switch.on, *(b - a for a, b in zip(self._mark, now))))
        self._mark = now

    def on_step_begin(self, args, state, control, **kwargs):
        self._close_step()
        if not self.fixed:
            self.switch.on = (state.global_step % 2 == 0) == self.first_on
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._close_step()
        return control


def train_once(model_path: str, workdir: Path, steps: int, tag: str, switch: Switch, first_on: bool,
               store: bool = True, whole: bool = False) -> list[tuple[bool, float, float, float]]:
    """One training. ``whole``: the training is watched (``first_on``) or not watched at all."""
    clock = StepClock(switch, first_on, fixed=whole)
    switch.on = first_on
    trainer = make_trainer(model_path, workdir / f"out-{tag}", callbacks=[clock], max_steps=steps)
    watched = first_on or not whole
    if watched:
        options = dict(run=f"bench-{tag}", port=0, store=str(workdir / f"{tag}.db") if store else None)
        watch = rltrl.watch(trainer, **{**options, **WATCH_OPTIONS})
    trainer.train()
    if watched:
        watch.flush()
        if watch._worker is not None:
            BACKGROUND["cpu_seconds"] += watch._worker.busy_seconds
            BACKGROUND["on_steps"] += sum(1 for s in clock.steps if s[0])
        rltrl.unwatch(trainer)
    return clock.steps[WARMUP_STEPS:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainings", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per training")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-store", action="store_true", help="watch without the run store (and its alerts)")
    parser.add_argument("--whole-trainings", action="store_true",
                        help="compare whole trainings watched and not watched at all (ABBA order) instead of "
                             "alternating steps; the honest design when rlwatch computes in the background "
                             "(the default of the TRL hook), whose work for one step overlaps the next")
    parser.add_argument("--foreground", action="store_true", help="compute on the training thread (background=False)")
    parser.add_argument("--no-hacks", action="store_true", help="without the reward-hack detectors")
    opts = parser.parse_args()
    if opts.foreground:
        WATCH_OPTIONS["background"] = False
    if os.environ.get("RLWATCH_BENCH_OPTIONS"):          # diagnosis only: extra Watch options as JSON
        import json

        WATCH_OPTIONS.update(json.loads(os.environ["RLWATCH_BENCH_OPTIONS"]))
    if opts.no_hacks:
        WATCH_OPTIONS["hack_detectors"] = False
    if opts.threads:
        torch.set_num_threads(opts.threads)
    logging.getLogger("rlwatch").setLevel(logging.ERROR)       # the random model trips alerts; keep it quiet
    import transformers

    transformers.logging.set_verbosity_error()
    workdir = Path(tempfile.mkdtemp(prefix="rlwatch-bench-trl-"))
    model_path = build_tiny_model(workdir)
    switch = Switch()
    steps: list[tuple[bool, float, float, float]] = []
    per_training: list[tuple[bool, float]] = []         # (watched, median step wall time)
    devnull = open(os.devnull, "w")
    for t in range(opts.trainings):
        stdout, sys.stdout = sys.stdout, devnull                     # TRL prints every log line
        try:
            first_on = t % 4 in (0, 3) if opts.whole_trainings else t % 2 == 0
            measured = train_once(model_path, workdir, opts.steps, str(t), switch, first_on=first_on,
                                  store=not opts.no_store, whole=opts.whole_trainings)
            steps += measured
            per_training.append((first_on, statistics.median(s[1] for s in measured)))
        finally:
            sys.stdout = stdout
        off = [s for s in steps if not s[0]]
        on = [s for s in steps if s[0]]
        med = {arm: f"{statistics.median(x[1] for x in rows) * 1e3:.1f} ms" if rows else "-"
               for arm, rows in (("off", off), ("on", on))}
        print(f"training {t + 1}/{opts.trainings}: median wall off {med['off']}, on {med['on']}", flush=True)

    off = [s for s in steps if not s[0]]
    on = [s for s in steps if s[0]]
    wall_off, wall_on = statistics.median(s[1] for s in off), statistics.median(s[1] for s in on)
    cpu_off, cpu_on = statistics.median(s[2] for s in off), statistics.median(s[2] for s in on)
    hooks = [s[3] for s in on]
    print(f"\ncommand: PYTHONPATH=. {os.path.relpath(sys.executable)} {' '.join(sys.argv)}")
    print(f"torch intra-op threads: {torch.get_num_threads()}; steps measured: {len(off)} off, {len(on)} on "
          f"({opts.trainings} trainings x {opts.steps - WARMUP_STEPS} steps, "
          f"{'whole trainings watched or not, ABBA' if opts.whole_trainings else 'alternating'})")
    print(f"median wall time per step: off {wall_off * 1e3:.1f} ms, on {wall_on * 1e3:.1f} ms, "
          f"ratio {wall_on / wall_off:.4f} ({(wall_on / wall_off - 1) * 100:+.2f}%)")
    print(f"median CPU time per step:  off {cpu_off * 1e3:.1f} ms, on {cpu_on * 1e3:.1f} ms, "
          f"ratio {cpu_on / cpu_off:.4f} ({(cpu_on / cpu_off - 1) * 100:+.2f}%)")
    print(f"inside rlwatch's hooks on 'on' steps: median {statistics.median(hooks) * 1e3:.2f} ms, "
          f"mean {statistics.mean(hooks) * 1e3:.2f} ms = {statistics.median(hooks) / wall_off * 100:.2f}% / "
          f"{statistics.mean(hooks) / wall_off * 100:.2f}% of the median 'off' step")
    if opts.whole_trainings:
        import random

        on_t = [m for watched, m in per_training if watched]
        off_t = [m for watched, m in per_training if not watched]
        rng = random.Random(0)
        boot = sorted(statistics.median(rng.choices(on_t, k=len(on_t))) /
                      statistics.median(rng.choices(off_t, k=len(off_t))) for _ in range(2000))
        ratio = statistics.median(on_t) / statistics.median(off_t)
        print(f"whole trainings: median of per-training medians, watched {statistics.median(on_t) * 1e3:.1f} ms, "
              f"not watched {statistics.median(off_t) * 1e3:.1f} ms: ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%), "
              f"bootstrap 95% interval {(boot[50] - 1) * 100:+.2f}% .. {(boot[1949] - 1) * 100:+.2f}%")
    if BACKGROUND["on_steps"]:
        per_step = BACKGROUND["cpu_seconds"] / BACKGROUND["on_steps"]
        print(f"CPU time of rlwatch's background thread per 'on' step: {per_step * 1e3:.2f} ms = "
              f"{per_step / wall_off * 100:.2f}% of the median 'off' step (runs beside the trainer, off its thread)")


if __name__ == "__main__":
    main()
