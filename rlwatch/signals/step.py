"""One step: every signal of a validated :class:`~rlwatch.core.record.StepRecord` with one host transfer.

The token and episode signals run as one function (:func:`.fused.step_core`, compiled by
:mod:`.engine` when ready, else eagerly in chunks of sequences), finished on the host by
:func:`.quantities.finish_tokens` and :func:`.quantities.finish_episodes`; then the entropy, the
policy KL (from ``updated_logp``) and the values the record states on the host, and :meth:`Pending.resolve`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from . import engine, plans, settings
from .buckets import LAG_BUCKETS, PROB_BIN_EDGES
from .durations import duration_core, finish_durations, rollout_values
from .episodes import bound_values
from .pending import Pending, Values, _div
from .quantities import device_constants, episode_layout, finish_episodes, finish_tokens, threshold_names
from .reduce import abs_bin_values, constant, plan
from .settings import Workspace
from .signal_config import SignalConfig

if TYPE_CHECKING:
    from .inputs import StepRecord

_BAND_THRESHOLDS = tuple(math.log(edge) for edge in PROB_BIN_EDGES)


def _fused_constants(config: SignalConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    """thresholds (the thresholds' device constants as :func:`.quantities.threshold_names` orders them, then
    the band edges), the |r| bin midpoints, the lag bucket bounds, the quantiles and the smallest lag over
    the staleness bound (made once)."""
    return _constants(tuple(config.thresholds.items()), device)


@plan(lambda: (threshold_names(),))
def _constants(values: tuple[tuple[str, Any], ...], device: torch.device) -> tuple:
    made = device_constants(dict(values))
    thresholds = constant((*(made[name] for name in threshold_names()[:-1]), *_BAND_THRESHOLDS), device)
    return (thresholds, abs_bin_values(device), constant(LAG_BUCKETS, device, torch.int64),
            constant((0.5, 0.99), device), constant((made["over_from"],), device).reshape(()))


class EpisodeInputs:
    """The episode inputs of :func:`episodes.episode_core` for one record, and how to read its block."""

    def __init__(self, record: "StepRecord", config: SignalConfig) -> None:
        device = record.mask.device
        B = record.batch_size
        if record.failed is not None:
            ok = torch.tensor([f is None for f in record.failed], dtype=torch.bool).to(device, non_blocking=True)
        else:
            ok = torch.ones(B, dtype=torch.bool, device=device)
        rewards = record.rewards
        groups = record.group_ids if rewards is not None else None
        envs = list(record.env_names) if record.env_index is not None else []
        self.detectors = list(record.hacked) if envs else []
        hacked = torch.stack([record.hacked[d] for d in self.detectors]) if self.detectors else None
        # The env sums have max(E, 2) rows, so that one compiled function serves every E (a
        # dimension of 1 would be specialised).
        # (uint8: never the same cached tensor as another input, which dynamo would guard on).
        slots = constant((0,) * max(len(envs), 2), device, torch.uint8) if envs else None
        self.reward_bounds = config.reward_bounds
        bounds = constant(bound_values(config.reward_bounds), device)
        self.tensors = (ok, rewards, groups, record.env_index if envs else None, slots, record.truncated,
                        hacked, bounds)
        self.envs = envs
        self.pos = episode_layout(rewards is not None, groups is not None, slots.numel() if envs else 0,
                                  record.truncated is not None, self.detectors)

    def finish(self, v: list[float]) -> "Values":
        return finish_episodes(v, self.pos, self.envs, self.detectors, self.reward_bounds)


def engine_inputs(record: "StepRecord", config: SignalConfig) -> tuple[tuple[Any, ...], bool]:
    """The token arguments of :func:`engine.run` for ``record`` and whether |r| quantiles are exact."""
    mask = record.mask
    mismatch = record.trainer_logp is not None and record.sampler_logp is not None
    lag = record.version is not None and record.trainer_version is not None
    device = mask.device
    exact = mask.numel() <= settings.EXACT_QUANTILE_MAX_TOKENS
    trainer_version = None
    if lag:     # float32 where every version up to trainer_version + 1 is one exactly (see lag.lag_part)
        dtype = torch.float32 if abs(record.trainer_version) < 2 ** 24 else torch.float64
        trainer_version = torch.tensor(float(record.trainer_version), dtype=dtype)
        trainer_version = trainer_version if device.type == "cpu" else trainer_version.to(device, non_blocking=True)
    version = record.version if lag else None
    if version is not None and version.shape != mask.shape:
        version = version.contiguous()          # [B] or [B, 2], often a strided slice: cheap to copy
    args = (mask, record.trainer_logp if mismatch else None, record.sampler_logp if mismatch else None,
            version, trainer_version, *_fused_constants(config, device))
    return args, exact


def token_signals(out: Pending, record: "StepRecord", config: SignalConfig, ws: Workspace | None,
                  episodes: EpisodeInputs | None = None) -> None:
    """The token-level signals (tokens, mismatch, importance sampling, version lag) and, when
    ``episodes`` is given, the episode signals, from the fused function (one vector), compiled when
    ready, else eagerly."""
    mismatch = record.trainer_logp is not None and record.sampler_logp is not None
    lag = record.version is not None and record.trainer_version is not None
    args, exact = engine_inputs(record, config)
    vector = engine.run(args, exact, ws.compile if ws is not None else "never",
                        episodes=episodes.tensors if episodes is not None else None)
    layout = plans.layout(mismatch, lag)

    def finish(v: list[float]) -> "Values":
        if ws is not None and v[layout.compiled] == 1.0:
            ws.compiled_steps += 1
        values = finish_tokens(v, layout.fields, mismatch, lag)
        if episodes is not None:
            values.update(episodes.finish(v[layout.size:]))
        return values
    out.host(finish, out.vector(vector))


def entropy_signal(out: Pending, entropy: torch.Tensor, mask: torch.Tensor, env_index: torch.Tensor | None = None,
                   env_names: list[str] | None = None) -> None:
    """Mean per-token entropy over masked tokens with a finite entropy (``entropy_mean``) and, with
    environments, the same per environment (``env_entropy_mean``). entropy, mask: [B, T]; env_index: [B]
    into ``env_names``."""
    e = entropy.to(torch.float32)
    good = mask * torch.isfinite(e)
    weighted = e.nan_to_num(0.0, 0.0, 0.0) * good
    out.ratio("entropy_mean", weighted.sum(), good.sum())
    if env_index is None or not env_names:
        return
    E = len(env_names)
    sums = torch.zeros(2, E, dtype=torch.float64, device=e.device)        # [entropy sums; token counts]
    sums[0].index_add_(0, env_index, weighted.sum(1, dtype=torch.float64))
    sums[1].index_add_(0, env_index, good.sum(1, dtype=torch.float64))
    out.host(lambda v: {"env_entropy_mean": {(name,): _div(v[k], v[E + k]) for k, name in enumerate(env_names)}},
             out.vector(sums))


def policy_kl_signal(out: Pending, updated_logp: torch.Tensor, trainer_logp: torch.Tensor,
                     mask: torch.Tensor) -> None:
    """``policy_kl``: the k3 estimate of KL(pi_old || pi_new) over the masked tokens where both
    log-probs are finite, mean exp(d) - d - 1 with d = updated_logp - trainer_logp (nats; d clamped to
    +-20 nats). updated_logp, trainer_logp, mask: [B, T]."""
    work = torch.float64 if torch.float64 in (updated_logp.dtype, trainer_logp.dtype) else torch.float32
    d = updated_logp.to(work) - trainer_logp.to(work)
    good = mask * torch.isfinite(d)
    d = d.nan_to_num(0.0, 0.0, 0.0).clamp(-20.0, 20.0)
    out.ratio("policy_kl", ((torch.expm1(d) - d) * good).sum(), good.sum())


def duration_signals(out: Pending, record: "StepRecord") -> None:
    """The episode-duration signals (:mod:`.durations`) when the record has durations or dropped
    episodes: one vector into the step's transfer."""
    rollout = record.rollout
    dropped = rollout.dropped
    B = record.batch_size
    if B == 0 or (rollout.durations is None and dropped is None):
        return
    d = rollout.durations
    if d is None:
        d = torch.full((B,), math.nan, dtype=torch.float64, device=record.mask.device)
    envs = list(record.env_names) if record.env_index is not None else []
    dd = dropped.durations if dropped is not None else None
    dl = dropped.lengths if dropped is not None else None
    vector = duration_core(d, record.env_index if envs else None, len(envs), dd, dl)
    out.host(lambda v: finish_durations(v, B, envs, record.env, dd is not None, dl is not None,
                                        dropped.reasons if dropped is not None else [],
                                        dropped.env if dropped is not None else []), out.vector(vector))


def compute_step(record: "StepRecord", config: SignalConfig, ws: Workspace | None = None) -> Values:
    """Every signal of one validated step, with exactly one host synchronisation.

    Returns ``{metric name: {label values: value}}`` using the names of :mod:`rlwatch.core.metrics`
    (gauges hold the step's value, counters the step's increment, the histogram its per-bucket
    counts). Names starting with ``_`` are internal checks, not exported. Runs in inference mode
    (no autograd bookkeeping on the few hundred small operations of a step).
    """
    with torch.inference_mode():
        return _compute_step(record, config, ws)


def _compute_step(record: "StepRecord", config: SignalConfig, ws: Workspace | None) -> Values:
    out = Pending()
    token_signals(out, record, config, ws, EpisodeInputs(record, config))
    if record.entropy is not None:
        entropy_signal(out, record.entropy, record.mask, record.env_index, record.env_names)
    if record.updated_logp is not None and record.trainer_logp is not None:
        policy_kl_signal(out, record.updated_logp, record.trainer_logp, record.mask)
    duration_signals(out, record)
    values = out.resolve()
    _put_record_values(values, record)
    rollout_values(values, record.batch_size, record.env, record.rollout.phases, record.rollout.dropped)
    return values


def _put_record_values(values: Values, record: "StepRecord") -> None:
    """The values the record states on the host (step, sizes, sampler settings) and the failures by
    kind, counted from the string labels."""
    B = record.batch_size
    values["step"] = {(): float(record.step)}
    values["steps_total"] = {(): 1.0}
    values["sequences"] = {(): float(B)}
    values["sequences_total"] = {(): float(B)}
    if record.trainer_version is not None:
        values["trainer_version"] = {(): float(record.trainer_version)}
    for key in ("temperature", "top_p", "top_k"):
        if key in record.sampling:
            values[f"sampler_{key}"] = {(): float(record.sampling[key])}
    if "logprobs_mode" in record.sampling:
        values["sampler_info"] = {(str(record.sampling["logprobs_mode"]),): 1.0}
    if record.failed is not None and record.env is not None:
        failures = Counter((e, kind) for e, kind in zip(record.env, record.failed) if kind)    # (env, kind)
        episodes = values.get("env_episodes", {})
        values["episodes_failed_total"] = {k: float(v) for k, v in failures.items()}
        values["env_failure_ratio"] = {
            (e, kind): (count / episodes[(e,)] if episodes.get((e,)) else None)
            for (e, kind), count in failures.items()}
        # Kinds seen earlier but absent now are reported as 0 by the exporter state.
