"""The scenario matrix behind the precision report: many runs, two policy families, two task sets.

Each run trains with the scenario engine (:mod:`rlwatch.demo.scenario`) with rlwatch attached and
records, per step, the signals rlwatch computed (the values ``Watch.observe`` returns, hack
verdicts included, without what the step listeners add) and the held-out true reward. Traces are
cached (one gzip pickle per run), so thresholds can be tuned by replaying the alert pipeline over
them (:mod:`evaluation.acceptance`) without training again.

Families: ``gru`` on copy/reverse (the demo's, 50 steps per run) and ``transformer`` (two causal
layers, learning rate 2e-3, 40 steps) on sort/shift. Seeds 0-2 form the tuning split, seeds 3-11
the test split.
"""

from __future__ import annotations

import gzip
import os
import pickle
import time
from dataclasses import dataclass, replace

#: Families: (policy, task set).
FAMILIES: dict[str, dict] = {"gru": {"policy": "gru", "tasks": "copy-reverse"},
                             "transformer": {"policy": "transformer", "tasks": "sort-shift", "lr": 2e-3}}
#: Steps per run of each family (the transformer is slower per step; its lag-8 runs collapse sooner).
FAMILY_STEPS: dict[str, int] = {"gru": 50, "transformer": 40}

#: Kinds: what rlwatch should say about a run. healthy: no critical alert; collapse: a critical alert
#: before the held-out reward collapses; lag_fault: lag far above the bound (critical by policy, the
#: run may survive thanks to TIS); semantic: OnPolicyRatioNotOne critical within 10 steps and firing
#: while the fault lasts; hack: the hack alert on the buggy environment only; infra: the failure
#: warning, no critical alert; intermittent: a sampler fault on every second or third step from step
#: 10 (one replica of several samples at temperature 5), critical within 10 steps of its start.
SCENARIOS: dict[str, tuple[str, dict]] = {
    "healthy_lag0": ("healthy", {}),
    "healthy_lag1": ("healthy", {"lag": 1}),
    "healthy_lag2": ("healthy", {"lag": 2}),
    "partial_lag1": ("healthy", {"lag": 1, "partial_rollouts": True}),
    "tis_lag2": ("healthy", {"lag": 2, "correction": "tis"}),
    "small_batch": ("healthy", {"prompts_per_step": 8}),
    "large_batch": ("healthy", {"prompts_per_step": 64}),
    "lr_low": ("healthy", {"lr_scale": 0.5}),
    "lr_high": ("healthy", {"lr_scale": 1.5, "lag": 1}),
    "rescued_lag8": ("lag_fault", {"lag": 8, "correction": "tis"}),
    "collapse_lag4": ("collapse", {"lag": 4}),
    "collapse_lag6": ("collapse", {"lag": 6}),
    "collapse_lag8": ("collapse", {"lag": 8}),
    "temperature": ("semantic", {"sampler_temperature": 0.6}),
    "top_p": ("semantic", {"sampler_top_p": 0.9}),
    "hack": ("hack", {"hack": True}),
    "infra": ("infra", {"failure_rate": 0.15, "failure_from": 15}),
    "infra_lag2": ("infra", {"failure_rate": 0.3, "failure_from": 10, "lag": 2}),
    "intermittent_2": ("intermittent", {"lag": 1, "intermittent_every": 2}),
    "intermittent_3": ("intermittent", {"lag": 1, "intermittent_every": 3}),
}

TUNING_SEEDS = (0, 1, 2)
#: Seeds 3-5 were the first test split, 6-8 were trained after the first tuning rule was fixed, 9-11
#: after the margin rule of :func:`evaluation.acceptance.tune` was fixed.
TEST_SEEDS = tuple(range(3, 12))
STEPS = 50
#: The buggy environment of each task set (the second one).
BUGGY_ENV = {"copy-reverse": "reverse", "sort-shift": "shift"}
#: Listener outputs that the replay recomputes.
DERIVED = ("drift_score", "diagnosis_info")


def derived(name: str) -> bool:
    """Whether a value is a step listener's output (recomputed by the replay) or internal."""
    return name in DERIVED or name.startswith(("alert_", "window_", "_"))


@dataclass(frozen=True)
class RunSpec:
    family: str
    scenario: str
    seed: int
    steps: int = STEPS

    @property
    def kind(self) -> str:
        return SCENARIOS[self.scenario][0]

    @property
    def name(self) -> str:
        return f"{self.family}-{self.scenario}-{self.seed}"

    @property
    def buggy_env(self) -> str:
        return BUGGY_ENV[FAMILIES[self.family]["tasks"]]

    def config(self):
        from rlwatch.demo.scenario import ScenarioConfig

        overrides = {**FAMILIES[self.family], **SCENARIOS[self.scenario][1]}
        scale = overrides.pop("lr_scale", 1.0)
        config = replace(ScenarioConfig(), seed=self.seed, steps=self.steps, threads=1, **overrides)
        return replace(config, lr=config.lr * scale)


def specs(seeds: tuple[int, ...], families: tuple[str, ...] = tuple(FAMILIES),
          scenarios: tuple[str, ...] = tuple(SCENARIOS), steps: int | None = None) -> list[RunSpec]:
    """Runs of the matrix, seed-major; ``steps`` replaces the families' own lengths."""
    return [RunSpec(f, s, seed, steps or FAMILY_STEPS[f]) for seed in seeds for f in families for s in scenarios]


def trace_path(cache: str, spec: RunSpec) -> str:
    return os.path.join(cache, f"{spec.name}-{spec.steps}.pkl.gz")


class _Unpickler(pickle.Unpickler):
    """Traces written by ``python -m evaluation.matrix`` name RunSpec as ``__main__.RunSpec``."""

    def find_class(self, module: str, name: str):
        if name == "RunSpec":
            return RunSpec
        return super().find_class(module, name)


def load_trace(path: str) -> dict:
    with gzip.open(path, "rb") as f:
        return _Unpickler(f).load()


def collect(spec: RunSpec, cache: str | None = None) -> dict:
    """Train one run with rlwatch attached; returns {"spec", "steps": [(step, values)], "heldout",
    "seconds"} and caches it under ``cache``."""
    if cache:
        path = trace_path(cache, spec)
        if os.path.exists(path):
            return load_trace(path)
    import torch

    from rlwatch import Watch
    from rlwatch.demo.scenario import run_scenario

    torch.set_num_threads(1)
    started = time.perf_counter()
    steps: list[tuple[int, dict]] = []
    watch = Watch(run=spec.name, port=None, store=None, alerts=False, staleness_bound=2, strict=False)

    def on_step(info) -> None:
        values = watch.observe(info.step, **info.fields, episodes=info.episodes)
        if watch.hacks is not None:
            # A toy step takes milliseconds, a real one minutes: wait for this step's reward-hack verdicts (the
            # detectors run in their own process) so that they reach the next step, as in a real run, and are
            # not counted many steps late in one lump, whatever the machine's load (as the demo does).
            watch.hacks.flush(timeout=30.0)
        if values is not None:
            steps.append((info.step, {k: dict(v) for k, v in values.items() if not derived(k)}))

    try:
        result = run_scenario(spec.config(), on_step=on_step)
    except RuntimeError as exc:          # the toy policy diverged (NaN probabilities): kept, reported
        watch.close()
        trace = {"spec": spec, "steps": steps, "heldout": [], "seconds": time.perf_counter() - started,
                 "error": f"{type(exc).__name__}: {exc}"}
        _save(cache, spec, trace)
        return trace
    if watch.hacks is not None:                       # the last step's verdicts
        watch.hacks.flush()
        values = watch.observe(spec.steps, mask=torch.ones(1, 1))
        if values is not None and steps:
            last = steps[-1][1]
            for name in ("episodes_hacked_total", "episodes_judged_total"):
                for labels, v in values.get(name, {}).items():
                    last.setdefault(name, {})[labels] = last.get(name, {}).get(labels, 0.0) + v
    watch.close()
    trace = {"spec": spec, "steps": steps, "heldout": result.heldout, "seconds": time.perf_counter() - started}
    _save(cache, spec, trace)
    return trace


def _save(cache: str | None, spec: RunSpec, trace: dict) -> None:
    if cache:
        os.makedirs(cache, exist_ok=True)
        tmp = trace_path(cache, spec) + f".{os.getpid()}.tmp"
        with gzip.open(tmp, "wb") as f:
            pickle.dump(trace, f)
        os.replace(tmp, trace_path(cache, spec))


def collect_all(run_specs: list[RunSpec], cache: str, jobs: int = 1) -> list[dict]:
    if jobs <= 1:
        return [collect(s, cache) for s in run_specs]
    import concurrent.futures

    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(collect, run_specs, [cache] * len(run_specs)))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Train the scenario matrix and cache its traces.")
    parser.add_argument("--split", choices=("tuning", "test", "all"), default="all")
    parser.add_argument("--cache", default=".rlwatch-matrix")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps per run (default: each family's FAMILY_STEPS)")
    args = parser.parse_args(argv)
    seeds = {"tuning": TUNING_SEEDS, "test": TEST_SEEDS, "all": TUNING_SEEDS + TEST_SEEDS}[args.split]
    started = time.perf_counter()
    traces = collect_all(specs(seeds, steps=args.steps), args.cache, args.jobs)
    print(f"{len(traces)} runs in {time.perf_counter() - started:.0f} s (cache {args.cache})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
