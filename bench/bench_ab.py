"""This checkout's compute_step against another revision's, in one process, alternating.

On a shared host two benchmark processes run minutes apart see different neighbours; two engines
timed in turn inside one process see the same ones. The other revision's ``rlwatch`` package is
extracted from git (``git archive``) into a temporary directory and imported under another name
(it must import itself only relatively: checked after its first step); both engines get the same inputs
(``bench_signals.make_inputs``) and one intra-op thread.

    python bench/bench_ab.py 19f367c                  # 8x64, every field
    python bench/bench_ab.py 19f367c --B 512 --T 2048 --rounds 10 --steps 3
    python bench/bench_ab.py 19f367c --without-by lag  # this engine without its split-by-lag sums

Prints the median CPU time per step (``time.process_time``) of each and their ratio (this / other).
``--without-by KIND`` drops this checkout's token sums split by KIND and the metrics that read them
(the declaration in ``rlwatch/signals/quantities/``): the signal set of an engine from before them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_signals import make_inputs  # noqa: E402


def load_revision(revision: str, into: Path) -> str:
    """Extract ``revision``'s rlwatch/ into ``into`` as package ``rlwatch_<revision>``; its name."""
    name = "rlwatch_" + re.sub(r"\W", "_", revision)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision, "rlwatch"],
                             capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"git archive {revision}: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    (into / "rlwatch").rename(into / name)
    sys.path.insert(0, str(into))
    return name


def runner(package: str, inputs: dict, without_by: str | None = None):
    """One compute_step of ``package`` on ``inputs`` (eager), as a callable."""
    signals = importlib.import_module(f"{package}.signals")
    core = f"{package}.core" if importlib.util.find_spec(f"{package}.core") else package    # before the core moved
    record = importlib.import_module(f"{core}.record")
    errors = importlib.import_module(f"{core}.errors")
    if without_by:
        q = importlib.import_module(f"{package}.signals.quantities")
        dropped = {s.name for s in q.TOKEN_SUMS if s.by == without_by}
        q.TOKEN_SUMS = tuple(s for s in q.TOKEN_SUMS if s.by != without_by)
        # A metric reads a dropped sum as an attribute of its fields: find them by name in its code.
        q.METRICS = tuple(m for m in q.METRICS if not dropped & set(m.fn.__code__.co_names))
    workspace = signals.Workspace(compile="never")
    builder, config = record.RecordBuilder(errors.HookErrors(strict=True)), signals.SignalConfig()
    return lambda: signals.compute_step(builder.build(0, inputs, workspace), config, workspace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revision", help="the other engine: a git revision of this repository")
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40, help="alternations (each engine once per round)")
    parser.add_argument("--steps", type=int, default=25, help="steps per engine per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--without-by", help="drop this checkout's token sums split by this kind (band, lag)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    inputs = make_inputs(args.B, args.T)
    with tempfile.TemporaryDirectory() as tmp:
        other = runner(load_revision(args.revision, Path(tmp)), inputs)
        other()
        if "rlwatch" in sys.modules:        # it imported itself by name: the steps would mix the two
            raise SystemExit(f"{args.revision}'s package imports `rlwatch` by name; it cannot run beside this one")
        this = runner("rlwatch", inputs, args.without_by)
        runs, times = (this, other), ([], [])
        for run in runs:
            for _ in range(args.warmup):
                run()
        for r in range(args.rounds):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                started = time.process_time()
                for _ in range(args.steps):
                    runs[i]()
                times[i].append((time.process_time() - started) / args.steps * 1e3)
    mine, theirs = statistics.median(times[0]), statistics.median(times[1])
    names = ["this checkout" + (f" without the by-{args.without_by} sums" if args.without_by else ""), args.revision]
    width = max(map(len, names))
    print(f"B={args.B} T={args.T}, torch {torch.__version__}, 1 thread, {args.rounds} alternating rounds of "
          f"{args.steps} steps (CPU time medians)")
    for name, ms in zip(names, (mine, theirs)):
        print(f"  {name:<{width}}  {ms:9.3f} ms")
    print(f"  ratio this / {args.revision} = {mine / theirs:.3f}")


if __name__ == "__main__":
    main()
