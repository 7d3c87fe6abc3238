"""The length-bias alert's bound (``length_bias_max``, RLWatchRolloutLengthBias), chosen on a tuning
split and reported on a test split of simulated rollout systems.

Each run is 40 steps of B trained episodes whose durations come from a duration generator; the
episodes launched but not trained follow a scenario. Healthy scenarios drop episodes independently
of their duration (filtered groups, stale at consumption) or drop none; biased ones drop the long
ones (a constant failure hazard, a timeout at the generator's 90th percentile, over-sampling that
trains the first B to finish). Every step goes through ``rlwatch.compute`` (the real signals) and
the real step windows (``AlertWindows``) with the alert alone.

Generators: ``agent`` (the reference text's duration model of Section 13.2, written from its
description: a geometric number of turns, uniform tokens per turn at a per-sequence decode rate,
a log-normal tool latency per turn), ``agent_short`` (fewer turns, slower and more variable
tools) and ``lognormal`` (plain log-normal durations). Tuning: ``agent``, seeds 0-2, B = 32 and 64.
Test: seeds 3-11 of all three generators, B = 32 and 128.

The bound: :data:`MARGIN` x the smallest of :data:`BOUNDS` at which no healthy tuning run opens the
alert (the next grid value at or above).
``python -m evaluation.rollout_bias --out alerts/length-bias-acceptance`` writes the report (about
three minutes).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable

import torch

STEPS = 40
BOUNDS = tuple(round(0.005 * k, 3) for k in range(1, 41))          # 0.005 .. 0.2
HEALTHY = ("none", "random_filter", "random_stale")
BIASED = ("failure_hazard_1000s", "failure_hazard_2000s", "timeout_p90", "oversample_25pct")
#: The bound is this many times the smallest grid bound with no healthy opening on the tuning split
#: (a margin for generators and batch sizes the tuning split does not have).
MARGIN = 1.5
GENERATORS = ("agent", "agent_short", "lognormal")


def agent_durations(n: int, g: torch.Generator, mean_turns: float = 8, max_turns: int = 40,
                    tokens: tuple[int, int] = (100, 600), decode_rate: float = 40.0, tool_median: float = 2.0,
                    tool_sigma: float = 1.0) -> torch.Tensor:
    """[n] seconds: per turn, uniform tokens / decode rate plus a log-normal tool wait; geometric turns."""
    p = 1.0 / mean_turns
    turns = torch.floor(torch.log(1 - torch.rand(n, generator=g, dtype=torch.float64)) / math.log(1 - p)) + 1
    turns = turns.clamp(1, max_turns)
    decode = (tokens[0] + (tokens[1] - tokens[0]) * torch.rand(n, max_turns, generator=g, dtype=torch.float64))
    tool = tool_median * torch.exp(tool_sigma * torch.randn(n, max_turns, generator=g, dtype=torch.float64))
    used = torch.arange(max_turns)[None] < turns[:, None]
    return ((decode / decode_rate + tool) * used).sum(1)


def generator(name: str) -> Callable[[int, torch.Generator], torch.Tensor]:
    if name == "agent":
        return agent_durations
    if name == "agent_short":
        return lambda n, g: agent_durations(n, g, mean_turns=4, decode_rate=25.0, tool_sigma=1.5)
    return lambda n, g: 60.0 * torch.exp(1.0 * torch.randn(n, generator=g, dtype=torch.float64))


@dataclass
class Step:
    durations: torch.Tensor               # [B] trained
    dropped: torch.Tensor                 # [D] launched, not trained (seconds spent)
    reasons: list[str]


class Pool:
    """Durations drawn in one call and handed out in order (drawing per step costs more than the step)."""

    def __init__(self, draw: Callable, g: torch.Generator, size: int) -> None:
        self.draw, self.g, self.size = draw, g, size
        self.values, self.at = draw(size, g), 0

    def __call__(self, n: int, g: torch.Generator | None = None) -> torch.Tensor:
        if self.at + n > self.values.numel():
            self.values, self.at = self.draw(self.size, self.g), 0
        self.at += n
        return self.values[self.at - n:self.at]


def simulate_step(scenario: str, B: int, draw: Callable, g: torch.Generator, p90: float) -> Step:
    """One step's trained and dropped episodes under ``scenario``."""
    if scenario == "oversample_25pct":
        launched = draw(B + B // 4, g)
        order = launched.argsort()
        return Step(launched[order[:B]], launched[order[B:]], ["filtered"] * (B // 4))
    durations, drops = [], []
    while sum(int((~x).sum()) for x in drops) < B:          # launch in order until B episodes are kept
        d = draw(B, g)
        if scenario == "none":
            drop = torch.zeros(B, dtype=torch.bool)
        elif scenario in ("random_filter", "random_stale"):
            drop = torch.rand(B, generator=g) < (0.15 if scenario == "random_filter" else 0.05)
        elif scenario.startswith("failure_hazard_"):                  # a constant hazard per second
            hazard_s = float(scenario.split("_")[-1].rstrip("s"))
            drop = torch.rand(B, generator=g, dtype=torch.float64) < 1 - torch.exp(-d / hazard_s)
        else:                                           # timeout_p90: cut at the cap, dropped
            drop = d > p90
            d = torch.where(drop, torch.full_like(d, p90), d)
        durations.append(d)
        drops.append(drop)
    d, drop = torch.cat(durations), torch.cat(drops)
    launched = int(torch.nonzero(~drop)[B - 1]) + 1           # up to the B-th kept episode: the rest never ran
    d, drop = d[:launched], drop[:launched]
    reason = {"random_filter": "filtered", "random_stale": "stale", "timeout_p90": "timeout"}.get(
        scenario, "failure" if scenario.startswith("failure") else "other")
    return Step(d[~drop], d[drop], [reason] * int(drop.sum()))


def run_openings(scenario: str, gen: str, seed: int, B: int, bounds: tuple[float, ...]) -> dict[float, int | None]:
    """The first step at which the alert opens at each bound (None: never) for one simulated run."""
    from rlwatch.alerts.domains.rollout import ROLLOUT_LENGTH_BIAS
    from rlwatch.alerts.windows import AlertWindows
    from rlwatch import compute

    g = torch.Generator().manual_seed(seed * 1000 + B)
    p90 = generator(gen)(20_000, torch.Generator().manual_seed(10_000 + seed)).quantile(0.9).item()
    draw = Pool(generator(gen), g, STEPS * B * 2)
    windows = {b: AlertWindows({"length_bias_max": b}, alerts=[ROLLOUT_LENGTH_BIAS]) for b in bounds}
    first: dict[float, int | None] = dict.fromkeys(bounds)
    mask = torch.ones(B, 1)
    for step in range(STEPS):
        s = simulate_step(scenario, B, draw, g, p90)
        values = compute(step=step, mask=mask, durations=s.durations, dropped_reasons=s.reasons,
                         dropped_durations=s.dropped)
        for b, w in windows.items():
            out = w.on_step(step, values)
            if first[b] is None and any(k[-1] == "open" for k in out.get("alert_incident", {})):
                first[b] = step
    return first


def evaluate(splits: dict[str, list[tuple[str, int, int]]], bounds: tuple[float, ...]) -> dict:
    """{split: {(scenario, generator, seed, B): {bound: first opening}}}."""
    out: dict[str, dict] = {}
    for split, runs in splits.items():
        out[split] = {}
        for gen, seed, B in runs:
            for scenario in HEALTHY + BIASED:
                out[split][(scenario, gen, seed, B)] = run_openings(scenario, gen, seed, B, bounds)
    return out


def choose_bound(tuning: dict) -> float:
    """:data:`MARGIN` x the smallest bound at which no healthy tuning run opens, on the grid."""
    for b in BOUNDS:
        if all(first[b] is None for key, first in tuning.items() if key[0] in HEALTHY):
            return min((x for x in BOUNDS if x >= MARGIN * b - 1e-9), default=BOUNDS[-1])
    return BOUNDS[-1]


SPLITS = {"tuning": [("agent", seed, B) for seed in (0, 1, 2) for B in (32, 64)],
          "test": [(gen, seed, B) for gen in GENERATORS for seed in range(3, 12) for B in (32, 128)]}


def report(results: dict, bound: float, command: str) -> str:
    lines = ["<!-- Written by `python -m evaluation.rollout_bias`. -->", "# Length-bias alert acceptance", "",
             f"Command: `{command}`.", "",
             f"RLWatchRolloutLengthBias opens when 1 - the mean trained/launched duration ratio over 10 steps "
             f"exceeds `length_bias_max` for 3 steps. Bound chosen on the tuning split (agent generator, seeds "
             f"0-2, B = 32 and 64: {MARGIN:g} x the smallest bound with no healthy opening): **{bound:g}**. Runs of "
             f"{STEPS} steps; the test split is seeds 3-11 of three generators ({', '.join(GENERATORS)}) at "
             f"B = 32 and 128.", "",
             "| split | scenario | runs | opened | median first step |", "|---|---|---|---|---|"]
    for split in ("tuning", "test"):
        for scenario in HEALTHY + BIASED:
            firsts = [first[bound] for key, first in results[split].items() if key[0] == scenario]
            opened = sorted(f for f in firsts if f is not None)
            median = opened[len(opened) // 2] if opened else "-"
            lines.append(f"| {split} | {scenario}{' (healthy)' if scenario in HEALTHY else ''} | {len(firsts)} | "
                         f"{len(opened)} | {median} |")
    lines += ["", "Per test generator (opened / runs):", "", "| generator | healthy | biased |", "|---|---|---|"]
    for gen in GENERATORS:
        cells = []
        for group in (HEALTHY, BIASED):
            firsts = [first[bound] for key, first in results["test"].items() if key[1] == gen and key[0] in group]
            cells.append(f"{sum(f is not None for f in firsts)}/{len(firsts)}")
        lines.append(f"| {gen} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="alerts/length-bias-acceptance")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = evaluate(SPLITS, BOUNDS)
    bound = choose_bound(results["tuning"])
    command = "python -m evaluation.rollout_bias" + (f" --out {args.out}" if args.out else "")
    text = report(results, bound, command)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
