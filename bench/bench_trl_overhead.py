"""Step-time overhead of the TRL integration on the tiny CPU GRPOTrainer of the tests.

Every training is watched with the default one-line setup (``rlwatch.integrations.trl.watch(trainer)``:
/metrics endpoint, run store, in-process alerts, reward-hack detectors; on CPU each step is computed
on the training thread, ``--background`` computes it on rlwatch's own thread instead), and
rlwatch's work is switched on for some optimizer steps only. On an "off" step the wrappers still run
but return at once, so no sample is stamped or captured, nothing is observed and no logs are
forwarded. A step runs from one ``on_step_begin`` to the next. The tiny trainer generates one batch
per step, so a watched step carries both of the hook's computations: the step's token-level signals
and the generation batch's episode-level ones.

Designs (the default is ``cycles``):

- ``cycles``: one step in four is watched (see ``bench/_paired.py``): the watched step and the next
  one (where, with ``--background``, rlwatch's thread computes the watched step beside the trainer)
  against the two after them, cycle by cycle. Cycles whose baseline began before rlwatch's thread
  had finished are dropped and counted.
- ``--alternate``: every other step watched, medians per arm. Understates a background cost, whose
  work lands in the following (off) step.
- ``--whole-trainings``: whole trainings watched and not watched (ABBA); free of attribution
  questions but at the mercy of the machine's drift between trainings.

``--sidecar`` is an experiment (``bench/_sidecar.py``): the training thread captures and assembles
each step as usual, then pickles its fields to a child process that computes and exports them (the
token-level record only: the episode-level values of the generation batches are left out there).

Also reported: the time inside rlwatch's hooks on the training thread and the CPU time of
rlwatch's thread per watched step. The first ``WARMUP_STEPS`` steps of each training are dropped.
Run:

    PYTHONPATH=. python bench/bench_trl_overhead.py [--trainings 8] [--steps 42] [--threads N] [--no-store]
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
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from bench import _paired  # noqa: E402
from rlwatch.integrations import trl as rltrl  # noqa: E402
from tests._trl_tiny import build_tiny_model, make_trainer  # noqa: E402

WARMUP_STEPS = 4            # a whole cycle, so that measured steps start at a watched one
WATCH_OPTIONS: dict = {}
BACKGROUND = {"cpu_seconds": 0.0, "on_steps": 0}     # rlwatch's own thread (background=True) or process


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
    """Sets the switch at each step begin and records one ``Step`` per step."""

    def __init__(self, switch: Switch, design: str, first_on: bool) -> None:
        self.switch = switch
        self.design = design                # "cycles", "alternate" or "whole"
        self.first_on = first_on
        self.watch = None                   # set once the Watch exists (backlog of rlwatch's thread)
        self.steps: list[Step] = []
        self._mark: tuple[float, float, float] | None = None
        self._index = 0
        self._backlog = 0

    def _close_step(self) -> None:
        now = (time.perf_counter(), time.process_time(), self.switch.hook_seconds)
        if self._mark is not None:
            self.steps.append(Step(self._index - 1, self.switch.on, *(b - a for a, b in zip(self._mark, now)),
                                   self._backlog))
        self._mark = now

    def on_step_begin(self, args, state, control, **kwargs):
        self._close_step()
        worker = getattr(self.watch, "_worker", None)
        self._backlog = worker._queue.unfinished_tasks if worker is not None else 0
        if self.design == "cycles":
            self.switch.on = _paired.watched(self._index)
        elif self.design == "alternate":
            self.switch.on = (self._index % 2 == 0) == self.first_on
        self._index += 1
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._close_step()
        return control


class Step(NamedTuple):
    index: int
    on: bool
    wall: float
    cpu: float
    hook: float
    backlog: int          # jobs of rlwatch's thread not finished when the step began


def train_once(model_path: str, workdir: Path, steps: int, tag: str, switch: Switch, design: str,
               first_on: bool, store: bool = True, sidecar_process: bool = False) -> list[Step]:
    """One training. With ``design="whole"`` the training is watched (``first_on``) or not at all."""
    clock = StepClock(switch, design, first_on)
    switch.on = first_on
    trainer = make_trainer(model_path, workdir / f"out-{tag}", callbacks=[clock], max_steps=steps)
    watched = first_on or design != "whole"
    sidecar = None
    if watched:
        options = dict(run=f"bench-{tag}", port=0, store=str(workdir / f"{tag}.db") if store else None)
        if sidecar_process:
            from bench import _sidecar

            # The trainer's Watch captures only (no endpoint, store or alerts); the child exports.
            clock.watch = rltrl.watch(trainer, **{**options, **WATCH_OPTIONS, "port": None, "store": None,
                                                  "background": False})
            sidecar = _sidecar.attach(clock.watch, **{**options, **WATCH_OPTIONS, "hack_detectors": False,
                                                      "framework": "trl",
                                                      "group_size": clock.watch.signal_config.group_size})
        else:
            clock.watch = rltrl.watch(trainer, **{**options, **WATCH_OPTIONS})
    trainer.train()
    if sidecar is not None:
        sidecar.close()
        BACKGROUND["cpu_seconds"] += sidecar.busy_seconds
        BACKGROUND["on_steps"] += sum(1 for s in clock.steps if s.on)
    if watched:
        clock.watch.flush()
        if clock.watch._worker is not None:
            BACKGROUND["cpu_seconds"] += clock.watch._worker.busy_seconds
            BACKGROUND["on_steps"] += sum(1 for s in clock.steps if s.on)
        rltrl.unwatch(trainer)
    return clock.steps[WARMUP_STEPS:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainings", type=int, default=8)
    parser.add_argument("--steps", type=int, default=42, help="optimizer steps per training")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-store", action="store_true", help="watch without the run store (and its alerts)")
    design = parser.add_mutually_exclusive_group()
    design.add_argument("--alternate", action="store_true", help="every other step watched (see the docstring)")
    design.add_argument("--whole-trainings", action="store_true",
                        help="whole trainings watched and not watched at all, ABBA (see the docstring)")
    thread = parser.add_mutually_exclusive_group()
    thread.add_argument("--foreground", action="store_true", help="compute on the training thread (background=False)")
    thread.add_argument("--background", action="store_true",
                        help="compute on rlwatch's thread (background=True, the hook's default on accelerators)")
    thread.add_argument("--sidecar", action="store_true",
                        help="experiment: compute and export in a child process (bench/_sidecar.py)")
    parser.add_argument("--no-hacks", action="store_true", help="without the reward-hack detectors")
    opts = parser.parse_args()
    design = "alternate" if opts.alternate else "whole" if opts.whole_trainings else "cycles"
    if opts.foreground or opts.background:
        WATCH_OPTIONS["background"] = opts.background
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
    steps: list[Step] = []
    overheads: list[float] = []
    dropped = 0
    per_training: list[tuple[bool, float]] = []         # (watched, median step wall time)
    devnull = open(os.devnull, "w")
    for t in range(opts.trainings):
        stdout, sys.stdout = sys.stdout, devnull                     # TRL prints every log line
        try:
            first_on = t % 4 in (0, 3) if design == "whole" else t % 2 == 0
            measured = train_once(model_path, workdir, opts.steps, str(t), switch, design, first_on,
                                  store=not opts.no_store, sidecar_process=opts.sidecar)
        finally:
            sys.stdout = stdout
        steps += measured
        per_training.append((first_on, statistics.median(s.wall for s in measured)))
        if design == "cycles":
            clean = [s.backlog == 0 for s in measured]
            found = _paired.cycle_overheads([s.wall for s in measured], measured[0].index, clean)
            dropped += len(_paired.cycle_overheads([s.wall for s in measured], measured[0].index)) - len(found)
            overheads += found
            progress = _paired.describe(overheads) if len(overheads) > 1 else "-"
        else:
            progress = ", ".join(f"{arm} {statistics.median(s.wall for s in steps if s.on == on) * 1e3:.1f} ms"
                                 for arm, on in (("off", False), ("on", True)) if any(s.on == on for s in steps))
        print(f"training {t + 1}/{opts.trainings}: {progress}", flush=True)

    off = [s for s in steps if not s.on]
    on = [s for s in steps if s.on]
    wall_off = statistics.median(s.wall for s in off)
    hooks = [s.hook for s in on]
    print(f"\ncommand: PYTHONPATH=. {os.path.relpath(sys.executable)} {' '.join(sys.argv)}")
    where = 'a child process' if opts.sidecar else 'its own thread' if BACKGROUND['on_steps'] else 'the training thread'
    print(f"torch intra-op threads: {torch.get_num_threads()}; {opts.trainings} trainings x "
          f"{opts.steps - WARMUP_STEPS} measured steps; design: {design}; rlwatch computes on {where}")
    if design == "cycles":
        print(f"cost of watching a step, paired 4-step cycles: {_paired.describe(overheads)}; "
              f"{dropped} cycles dropped (rlwatch's thread still busy when the baseline began)")
        print(f"median wall time of the baseline steps: {wall_off * 1e3:.1f} ms")
    else:
        wall_on = statistics.median(s.wall for s in on)
        cpu_off, cpu_on = statistics.median(s.cpu for s in off), statistics.median(s.cpu for s in on)
        print(f"median wall time per step: off {wall_off * 1e3:.1f} ms, on {wall_on * 1e3:.1f} ms, "
              f"ratio {wall_on / wall_off:.4f} ({(wall_on / wall_off - 1) * 100:+.2f}%)")
        print(f"median CPU time per step:  off {cpu_off * 1e3:.1f} ms, on {cpu_on * 1e3:.1f} ms, "
              f"ratio {cpu_on / cpu_off:.4f} ({(cpu_on / cpu_off - 1) * 100:+.2f}%)")
    print(f"inside rlwatch's hooks on watched steps: median {statistics.median(hooks) * 1e3:.2f} ms, "
          f"mean {statistics.mean(hooks) * 1e3:.2f} ms = {statistics.median(hooks) / wall_off * 100:.2f}% / "
          f"{statistics.mean(hooks) / wall_off * 100:.2f}% of the median unwatched step")
    if design == "whole":
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
        print(f"CPU time of rlwatch's {'process' if opts.sidecar else 'thread'} per watched step: "
              f"{per_step * 1e3:.2f} ms = {per_step / wall_off * 100:.2f}% of the median unwatched step "
              "(beside the trainer, off its thread)")


if __name__ == "__main__":
    main()
