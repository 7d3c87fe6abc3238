"""The real-scale evaluation family: synthetic runs at the magnitudes of language-model RL runs.

The toy matrix (:mod:`evaluation.matrix`) trains tiny policies whose sampler-learner mismatch is
10-1000x a language model's. This family draws, per step, token-level log-prob pairs whose k3,
mean |log-ratio| and effective sample size follow published magnitudes (docs/real-scale.md lists
each with its source) and replays them through ``rlwatch.Watch``, so rlwatch's own engine computes
every signal:

- the per-token log-ratio r = log pi_old - log mu is 0 up to tiny noise on most tokens and
  N(-s^2/2, s^2) on a fraction ``q`` of them (E_mu[exp r] = 1, k3 = q s^2 / 2): bf16 k3 1e-3 with
  q = 0.1 gives mean |r| 0.011 and ESS 0.998; MoE q = 0.02, k3 1.5e-2 gives ESS 0.94;
- the other signals at realistic levels: async lag 0..``lag`` updates per sequence (a staleness bound
  equal to it), groups of 8 with prompt difficulties that leave ~25% of groups zero-variance, ~4%
  of responses truncated, rewards that collapse to ~0 at the collapse step.

Ground truth per run: the step the reward collapses (``Shape.collapse``) and the step k3 departs:
the first step from which the 9-step rolling median of the measured k3 stays above 10x the run's
baseline (the median k3 of steps 10-59) to the collapse.

Shapes are split by seed *and* by shape: :data:`TUNING` and :data:`TEST` share no baseline level
and no growth rate.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import statistics
import zlib
from dataclasses import dataclass

#: Tokens per step: B sequences of at most T tokens (response lengths vary).
BATCH, LENGTH, GROUP = 64, 128, 8
#: Steps of a healthy run.
HEALTHY_STEPS = 600
#: Largest per-token s^2 of the mismatched tokens; above it the mismatched fraction grows instead.
MAX_S2 = 2.0
#: Departure: k3 passes this many times its baseline for good.
DEPARTURE_FACTOR = 10.0
#: The learning rate every run logs (a warm-up run reaches it after its warm-up).
LR_PEAK = 1e-6


@dataclass(frozen=True)
class Shape:
    """One kind of run. ``base``: healthy k3; ``tail``: fraction of tokens carrying the mismatch.
    ``drift``: k3 multiplied by this over the run (healthy drift); ``spikes``: (step, factor) single
    steps; ``bump``: (start, steps, peak factor, settle factor) a rise that partly recovers;
    ``growth``: how k3 leaves its baseline before a collapse ("loglinear" over ``warning`` steps
    from 10x to ~1 nat, "step" a jump to ``jump`` x at ``depart``, "regression" a 30-step ramp to
    ``jump`` x then log-linear); ``depart``: designed departure step; ``warning``: designed steps
    from departure to the reward collapse. ``lag``: maximum async lag. ``warmup``: (steps, rise) a
    learning-rate warm-up over which k3 rises ``rise`` x (the update size squared) to a steady level."""

    name: str
    kind: str
    base: float
    tail: float
    drift: float = 1.0
    spikes: tuple[tuple[int, float], ...] = ()
    bump: tuple[int, int, float, float] | None = None
    growth: str = ""
    depart: int = 0
    warning: int = 0
    jump: float = 1.0
    lag: int = 1
    warmup: tuple[int, float] | None = None

    def learning_rate(self, t: int) -> float:
        """The learning rate at step ``t``: :data:`LR_PEAK`, or with ``warmup`` = (steps, k3 rise) a linear
        warm-up from LR_PEAK / sqrt(rise) to LR_PEAK over ``steps`` (k3 grows with the update size squared)."""
        if self.warmup is None:
            return LR_PEAK
        steps, rise = self.warmup
        start = 1.0 / math.sqrt(rise)
        return LR_PEAK * (start + (1.0 - start) * min(1.0, t / steps))

    @property
    def collapse(self) -> int | None:
        return self.depart + self.warning if self.growth else None

    @property
    def steps(self) -> int:
        return self.collapse + 40 if self.growth else HEALTHY_STEPS

    def multiplier(self, t: int) -> float:
        """k3 over its baseline at step ``t`` (before noise)."""
        m = self.drift ** (t / HEALTHY_STEPS) * (self.learning_rate(t) / self.learning_rate(0)) ** 2
        for at, factor in self.spikes:
            if t == at:
                m *= factor
        if self.bump is not None:
            start, length, peak, settle = self.bump
            if start <= t < start + length:
                m *= 1 + (peak - 1) * math.sin(math.pi * (t - start) / length)
            elif t >= start + length:
                m *= settle
        if self.growth:
            m *= self._growth(t)
        return m

    def _growth(self, t: int) -> float:
        top = 1.0 / self.base                                   # ~1 nat at the collapse
        if self.growth == "loglinear":
            rate = math.log(top / DEPARTURE_FACTOR) / self.warning     # per step, from 10x at depart
            return max(1.0, min(top * 3, DEPARTURE_FACTOR * math.exp(rate * (t - self.depart))))
        if self.growth == "step":
            if t < self.depart:
                return 1.0
            rate = math.log(top / self.jump) / self.warning
            return self.jump * math.exp(rate * (t - self.depart))
        if self.growth == "regression":           # a 30-step ramp ending at depart + 15, then a slow climb
            ramp_start = self.depart - 15
            if t < ramp_start:
                return 1.0
            if t < ramp_start + 30:
                return self.jump ** ((t - ramp_start) / 30)
            rate = math.log(top / self.jump) / (self.warning - 15)
            return self.jump * math.exp(rate * (t - ramp_start - 30))
        raise ValueError(self.growth)


def _collapse_loglinear(name: str, base: float, tail: float, warning: int, lag: int = 1) -> Shape:
    return Shape(name, "collapse", base, tail, growth="loglinear", depart=warning // 2 + 120, warning=warning,
                 lag=lag)


#: bf16 vLLM vs FSDP (k3 1e-3, mean |r| 0.011), fp16 (1e-5), fp8 and MoE baselines (ESS 0.98 / 0.94).
BF16, FP16, FP8, MOE = (1e-3, 0.1), (1e-5, 0.1), (4e-3, 0.03), (1.5e-2, 0.02)
#: Test-only baselines: another bf16 stack (5e-4) and a larger MoE (8e-3, ESS ~0.95).
BF16_LOW, MOE_B = (5e-4, 0.08), (8e-3, 0.015)

TUNING: tuple[Shape, ...] = (
    Shape("bf16_flat", "healthy", *BF16, lag=2),
    Shape("fp16_flat", "healthy", *FP16, lag=1),
    Shape("moe_flat", "healthy", *MOE, lag=2),
    Shape("bf16_drift", "healthy", *BF16, drift=2.0, lag=1),
    Shape("bf16_spikes", "healthy", *BF16, spikes=((150, 30.0), (320, 60.0), (480, 20.0)), lag=2),
    Shape("bf16_recovery", "healthy", *BF16, bump=(200, 60, 3.0, 1.4), lag=1),
    Shape("fp16_rise", "healthy", *FP16, drift=10.0, lag=1),
    Shape("bf16_warmup", "healthy", *BF16, warmup=(80, 12.0), lag=2),
    _collapse_loglinear("bf16_fast", *BF16, warning=150, lag=2),
    _collapse_loglinear("bf16_slow", *BF16, warning=500, lag=1),
    Shape("bf16_syncbug", "collapse", *BF16, growth="step", depart=300, warning=80, jump=30.0, lag=1),
    Shape("bf16_engine", "collapse", *BF16, growth="regression", depart=250, warning=200, jump=11.0, lag=2),
)

TEST: tuple[Shape, ...] = (
    Shape("bf16low_flat", "healthy", *BF16_LOW, lag=4),
    Shape("fp8_flat", "healthy", *FP8, lag=3),
    Shape("moeb_flat", "healthy", *MOE_B, lag=1),
    Shape("fp8_drift", "healthy", *FP8, drift=2.5, lag=2),
    Shape("bf16low_spikes", "healthy", *BF16_LOW, spikes=((100, 40.0), (260, 80.0), (261, 10.0), (530, 25.0)),
          lag=3),
    Shape("moeb_recovery", "healthy", *MOE_B, bump=(300, 80, 3.5, 1.5), lag=2),
    Shape("fp16_rise_fast", "healthy", *FP16, drift=12.0, spikes=((400, 20.0),), lag=4),
    Shape("bf16low_warmup", "healthy", *BF16_LOW, warmup=(150, 18.0), lag=3),
    _collapse_loglinear("fp8_fast", *FP8, warning=110, lag=3),
    _collapse_loglinear("bf16low_mid", *BF16_LOW, warning=300, lag=2),
    _collapse_loglinear("moeb_slow", *MOE_B, warning=550, lag=1),
    Shape("fp8_syncbug", "collapse", *FP8, growth="step", depart=250, warning=60, jump=50.0, lag=2),
    Shape("bf16low_engine", "collapse", *BF16_LOW, growth="regression", depart=300, warning=260, jump=12.0,
          lag=4),
)

TUNING_SEEDS = (0, 1)
TEST_SEEDS = (10, 11)
#: Test runs CI replays (tests/test_realscale.py): one shape of each kind, short ones.
CI_SAMPLE = ("bf16low_spikes", "fp8_fast", "fp8_syncbug")


@dataclass(frozen=True)
class RealRun:
    shape: Shape
    seed: int

    @property
    def name(self) -> str:
        return f"real-{self.shape.name}-{self.seed}"

    @property
    def kind(self) -> str:
        return self.shape.kind

    @property
    def family(self) -> str:
        return "real-scale"

    @property
    def scenario(self) -> str:
        return self.shape.name


def runs(split: str) -> list[RealRun]:
    shapes, seeds = (TUNING, TUNING_SEEDS) if split == "tuning" else (TEST, TEST_SEEDS)
    return [RealRun(shape, seed) for seed in seeds for shape in shapes]


def step_fields(shape: Shape, t: int, generator) -> dict:
    """One step's ``Watch.observe`` fields: [B, T] mask and log-probs, versions, [B] rewards, groups,
    truncation."""
    import torch

    k3 = shape.base * shape.multiplier(t) * float(torch.exp(0.1 * torch.randn((), generator=generator)))
    s2 = min(MAX_S2, 2 * k3 / shape.tail)
    q = min(1.0, 2 * k3 / s2)
    lengths = torch.randint(LENGTH // 4, LENGTH + 1, (BATCH,), generator=generator)
    positions = torch.arange(LENGTH)
    mask = (positions[None, :] < lengths[:, None]).float()
    truncated = lengths == LENGTH
    sampler = -torch.empty(BATCH, LENGTH).exponential_(1.5, generator=generator)      # log mu
    heavy = torch.rand(BATCH, LENGTH, generator=generator) < q
    r = torch.where(heavy, -s2 / 2 + math.sqrt(s2) * torch.randn(BATCH, LENGTH, generator=generator),
                    1e-4 * torch.randn(BATCH, LENGTH, generator=generator))
    trainer = sampler + r
    version = 10 + t
    lag = torch.randint(0, shape.lag + 1, (BATCH,), generator=generator)
    token_version = (version - lag)[:, None].expand(BATCH, LENGTH).clone()
    collapsed = shape.collapse is not None and t >= shape.collapse
    groups = torch.arange(BATCH) // GROUP
    difficulty = torch.rand(BATCH // GROUP, generator=generator) ** 0.7           # pass rate per prompt
    if collapsed:
        difficulty = difficulty * 0.02
    rewards = (torch.rand(BATCH, generator=generator) < difficulty[groups]).float()
    return {"mask": mask, "sampler_logp": sampler, "trainer_logp": trainer, "token_version": token_version,
            "trainer_version": version, "rewards": rewards, "group_ids": groups, "truncated": truncated}


def collect(run: RealRun, cache: str | None = None) -> dict:
    """Replay one run's tensors through a Watch; returns {"spec", "steps": [(step, values)],
    "collapse_step", "depart_step", "staleness_bound"}, cached as a gzip pickle under ``cache``."""
    path = os.path.join(cache, f"{run.name}.pkl.gz") if cache else None
    if path and os.path.exists(path):
        with gzip.open(path, "rb") as f:
            return pickle.load(f)
    import torch

    from rlwatch import Watch
    from .matrix import derived

    torch.manual_seed(run.seed)
    generator = torch.Generator().manual_seed(zlib.crc32(run.name.encode()))
    watch = Watch(run=run.name, port=None, store=None, alerts=False, staleness_bound=run.shape.lag, strict=True)
    steps: list[tuple[int, dict]] = []
    try:
        for t in range(run.shape.steps):
            values = watch.observe(t, **step_fields(run.shape, t, generator))
            watch.log_scalars(t, {"learning_rate": run.shape.learning_rate(t)})     # as TRL logs it
            if values is not None:
                values = watch.pipeline.join.values          # the step's values joined to the trainer's
                steps.append((t, {k: dict(v) for k, v in values.items() if not derived(k)}))
    finally:
        watch.close()
    k3 = [v.get("mismatch_kl_k3", {}).get((), math.nan) for _, v in steps]
    trace = {"spec": run, "steps": steps, "collapse_step": run.shape.collapse,
             "depart_step": departure(k3, run.shape.collapse), "staleness_bound": run.shape.lag}
    if path:
        os.makedirs(cache, exist_ok=True)
        with gzip.open(path + ".tmp", "wb") as f:
            pickle.dump(trace, f)
        os.replace(path + ".tmp", path)
    return trace


def departure(k3: list[float], collapse: int | None) -> int | None:
    """The first step from which the 9-step rolling median of ``k3`` stays above 10x the run's
    baseline (median of steps 10-59) up to ``collapse``; None for a run without a collapse."""
    if collapse is None:
        return None
    base = statistics.median(k3[10:60])
    smooth = [statistics.median(k3[max(0, i - 8):i + 1]) for i in range(len(k3))]
    above = [s > DEPARTURE_FACTOR * base for s in smooth[:collapse]]
    depart = collapse
    while depart > 0 and above[depart - 1]:
        depart -= 1
    return depart


def collect_all(selected: list[RealRun], cache: str | None, jobs: int = 1) -> list[dict]:
    if jobs <= 1:
        return [collect(r, cache) for r in selected]
    import concurrent.futures

    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(collect, selected, [cache] * len(selected)))


__all__ = ["CI_SAMPLE", "RealRun", "Shape", "TEST", "TEST_SEEDS", "TUNING", "TUNING_SEEDS", "collect",
           "collect_all", "departure", "runs", "step_fields"]
