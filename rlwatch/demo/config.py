"""The settings of one demo training run (:class:`ScenarioConfig`); the run is :mod:`rlwatch.demo.scenario`."""

from __future__ import annotations

from dataclasses import dataclass

#: Task sets: the two environments' names (the second one's grader carries the ``hack`` bug). The
#: token of the first environment is 13, of the second 14, whatever the set.
TASK_SETS: dict[str, tuple[str, str]] = {"copy-reverse": ("copy", "reverse"), "sort-shift": ("sort", "shift")}


@dataclass
class ScenarioConfig:
    """One training run. Defaults are the calibrated "healthy" run.

    lag: behaviour-policy staleness in updates (the sampler uses version ``max(0, v - lag)``).
    correction: "none" | "tis" | "mis" (behaviour weights ``w = pi_old / mu``).
    sampler_temperature / sampler_top_p: what the sampler samples and reports at, when it differs
        from the trainer (a semantics fault). None means "same as the trainer".
    partial_rollouts: a fraction of the sequences start with a version one older than the
        sampler's and switch to the sampler's version mid-sequence.
    hack: the ``reverse`` grader has a bug (any prefix of the target, the empty answer included,
        gets reward 1); the true checker is unchanged.
    policy: "gru" (the default family) or "transformer" (a two-layer causal transformer).
    tasks: a key of ``TASK_SETS``: "copy-reverse" (the default) or "sort-shift" (answer the digits
        sorted ascending / each digit plus one modulo 10).
    failure_rate / failure_from: from step ``failure_from`` on, this share of episodes fails for an
        infrastructure reason (reported as ``failed="timeout"``, scored 0 as many pipelines do).
    intermittent_every / intermittent_from / intermittent_temperature: an intermittent sampler fault
        (one of several replicas, or one of two alternating data sources, samples and reports at the
        wrong temperature): from step ``intermittent_from`` on, every ``intermittent_every``-th step is
        sampled at ``intermittent_temperature`` (0: no fault).
    sampler_precision: "bf16" (the sampler's logits rounded to bfloat16) or "fp8" (its output layer's
        weights rounded to float8 e4m3 with a per-row scale), a numerics fault at lag 0. None: float32.
    lag_jitter: each step's lag is drawn uniformly from 0..``lag`` (a varying lag).
    sync_stops_at: from this step on the sampler's weights are never updated again (a missing
        weight sync: its lag grows by one per update).
    """

    seed: int = 0
    steps: int = 100
    lag: int = 0
    correction: str = "none"
    tis_cap: float = 2.0
    mis_band: tuple[float, float] = (0.5, 5.0)
    sampler_temperature: float | None = None
    sampler_top_p: float | None = None
    partial_rollouts: bool = False
    hack: bool = False
    policy: str = "gru"
    tasks: str = "copy-reverse"
    failure_rate: float = 0.0
    failure_from: int = 0
    intermittent_every: int = 0
    intermittent_from: int = 10
    intermittent_temperature: float = 5.0
    sampler_precision: str | None = None
    lag_jitter: bool = False
    sync_stops_at: int | None = None
    # training
    trainer_temperature: float = 1.0
    lr: float = 6e-3
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 5         # linear lr warm-up over the first RL steps (a fresh Adam's first steps are sign-like)
    prompts_per_step: int = 32
    group_size: int = 8
    epochs: int = 2
    minibatches: int = 4
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    partial_credit: bool = False  # training reward = share of positions right (else exact match only)
    pretrain_steps: int = 150     # supervised warm start on correct answers before RL
    pretrain_lr: float = 3e-3
    pretrain_noise: float = 0.2   # probability that a demonstration digit is replaced by a random digit
    pretrain_extra: float = 0.6   # probability that a demonstration has one extra random digit before EOS
    # task and model
    min_digits: int = 1
    max_digits: int = 2
    # relative frequency of lengths min_digits..max_digits (uniform if empty)
    length_weights: tuple[float, ...] = (0.1, 0.9)
    max_response: int = 6
    embed_dim: int = 32
    hidden_dim: int = 64
    partial_fraction: float = 0.5
    # evaluation
    heldout_prompts: int = 128
    eval_greedy: bool = False     # held-out answers greedy, else sampled at the trainer temperature (fixed seed)
    eval_every: int = 1
    threads: int = 1              # torch intra-op threads during the run (0: leave as is); results depend on it

    def __post_init__(self) -> None:
        if self.correction not in ("none", "tis", "mis"):
            raise ValueError(f"correction must be 'none', 'tis' or 'mis', got {self.correction!r}")
        if self.lag < 0:
            raise ValueError(f"lag must be >= 0, got {self.lag}")
        if self.policy not in ("gru", "transformer"):
            raise ValueError(f"policy must be 'gru' or 'transformer', got {self.policy!r}")
        if self.tasks not in TASK_SETS:
            raise ValueError(f"tasks must be one of {', '.join(TASK_SETS)}, got {self.tasks!r}")
        if self.sampler_precision not in (None, "bf16", "fp8"):
            raise ValueError(f"sampler_precision must be None, 'bf16' or 'fp8', got {self.sampler_precision!r}")
        if self.max_response < self.max_digits + 1:
            raise ValueError("max_response must leave room for the longest answer and EOS")
