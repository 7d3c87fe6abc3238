"""One step: every signal of a validated :class:`~rlwatch.record.StepRecord` with one host transfer.

The token signals (tokens, mismatch, importance sampling, lag) run in the fused engine
(:mod:`.fused`, compiled by :mod:`.engine` when ready, else eagerly on small steps) or, on large
steps without a compiled engine, in the in-place path (:mod:`.mismatch`, :mod:`.lag`); the episode
signals (:mod:`.groups`, :mod:`.environments`) follow, then :meth:`Pending.resolve`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import fused, settings
from ..metrics import LAG_BUCKETS, PROB_BIN_EDGES, PROB_BIN_LABELS
from .environments import failure_counts
from .episodes import bound_values, env_columns, episode_core, episode_layout, finish_episodes
from .groups import entropy_signal
from .lag import _bucket_counts, lag_signals
from .mismatch import _ess_ratio, _ratio_of, _slope, mismatch_signals
from .pending import Pending, Values, _apply, _div
from .reduce import _ABS_VALUES, _abs_bin_values, _constant
from .settings import SignalConfig, Workspace

if TYPE_CHECKING:
    from ..record import StepRecord

_BAND_THRESHOLDS = tuple(math.log(edge) for edge in PROB_BIN_EDGES)


def _fused_constants(config: SignalConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    cap, (low, high) = config.is_cap, config.mis_band
    thresholds = _constant((cap - 1.0, 1.0 / cap - 1.0, low - 1.0, high - 1.0, *_BAND_THRESHOLDS,
                            math.log(cap), -math.log(cap), math.log(low), math.log(high)), device)
    mids = _ABS_VALUES.get(device)
    if mids is None:
        _abs_bin_values(device, torch.zeros((), device=device))
        mids = _ABS_VALUES[device]
    return (thresholds, mids, _constant(LAG_BUCKETS, device, torch.int64), _constant((0.5, 0.99), device),
            _constant((float(math.floor(config.staleness_bound)) + 1.0,), device).reshape(()))


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
        slots = _constant((0,) * max(len(envs), 2), device, torch.uint8) if envs else None
        self.reward_bounds = config.reward_bounds
        bounds = _constant(bound_values(config.reward_bounds), device)
        self.tensors = (ok, rewards, groups, record.env_index if envs else None, slots, record.truncated,
                        hacked, bounds)
        self.envs = envs
        self.columns = env_columns(rewards is not None, record.truncated is not None, self.detectors)
        self.pos = episode_layout(rewards is not None, groups is not None, slots.numel() if envs else 0,
                                  record.truncated is not None, self.detectors)

    def finish(self, v: list[float]) -> "Values":
        return finish_episodes(v, self.pos, self.envs, self.columns, self.detectors, self.reward_bounds)


def engine_inputs(record: "StepRecord", config: SignalConfig) -> tuple[tuple[Any, ...], bool]:
    """The token arguments of :func:`engine.run` for ``record`` and whether |r| quantiles are exact."""
    mask = record.mask
    mismatch = record.trainer_logp is not None and record.sampler_logp is not None
    lag = record.version is not None and record.trainer_version is not None
    device = mask.device
    exact = mask.numel() <= settings.EXACT_QUANTILE_MAX_TOKENS
    trainer_version = (torch.tensor(float(record.trainer_version), dtype=torch.float64).to(device, non_blocking=True)
                       if lag else None)
    version = record.version if lag else None
    if version is not None and version.shape != mask.shape:
        version = version.contiguous()          # [B] or [B, 2], often a strided slice: cheap to copy
    args = (mask, record.trainer_logp if mismatch else None, record.sampler_logp if mismatch else None,
            version, trainer_version, *_fused_constants(config, device))
    return args, exact


def token_signals(out: Pending, record: "StepRecord", config: SignalConfig, ws: Workspace | None,
                  episodes: EpisodeInputs | None = None) -> bool:
    """The token-level signals (tokens, mismatch, importance sampling, version lag) and, when
    ``episodes`` is given, the episode signals, from the fused engine (one function, one vector),
    compiled when ready, else eagerly on small steps. False when the caller should use the in-place
    path (a large step with no compiled engine yet)."""
    from . import engine

    mask = record.mask
    mismatch = record.trainer_logp is not None and record.sampler_logp is not None
    lag = record.version is not None and record.trainer_version is not None
    device = mask.device
    n_all = mask.numel()
    compile = ws.compile if ws is not None else "never"
    if n_all > settings.FUSED_EAGER_MAX_TOKENS and not engine.wants_compile(device, compile):
        return False
    args, exact = engine_inputs(record, config)
    vector, _ = engine.run(args, exact, compile, eager=n_all <= settings.FUSED_EAGER_MAX_TOKENS,
                           episodes=episodes.tensors if episodes is not None else None)
    if vector is None:
        return False
    pos = fused.layout(mismatch, lag, len(PROB_BIN_LABELS), len(LAG_BUCKETS))

    def finish(v: list[float]) -> "Values":
        if ws is not None and v[pos["compiled"]] == 1.0:
            ws.compiled_steps += 1
        values = _finish_tokens(v, pos, mismatch, lag)
        if episodes is not None:
            values.update(episodes.finish(v[pos["size"]:]))
        return values
    out.host(finish, out.vector(vector))
    return True


def _finish_tokens(v: list[float], pos: dict[str, Any], mismatch: bool, lag: bool) -> "Values":
    """The host formulas of the token signals from :func:`fused.token_core`'s vector."""
    def at(name: str) -> float:
        return v[pos[name]]

    tokens = at("tokens")
    out: Values = {"tokens": {(): tokens}, "tokens_total": {(): tokens}}

    def put(name: str, value: float | None, labels: tuple[str, ...] = ()) -> None:
        out.setdefault(name, {})[labels] = value

    if mismatch:
        _finish_mismatch(at, v[pos["band_abs"]], v[pos["band_positions"]], put)
    if lag:
        _finish_lag(at, v[pos["lag_cum"]], put, out)
    return out


def _finish_mismatch(at: Callable[[str], float], band_abs: list[float], band_positions: list[float],
                     put: Callable[..., None]) -> None:
    """The mismatch and importance-sampling formulas from the fused vector's fields (``at``)."""
    n = at("n")
    nonfinite = at("tokens") - n
    # Positions off the valid set fall in the last band: it holds the valid tokens the others do not.
    band_tokens = [*band_positions[:-1], n - sum(band_positions[:-1])]
    for name, value in (("nonfinite_tokens", nonfinite), ("nonfinite_tokens_total", nonfinite),
                        ("mismatch_tokens", n), ("mismatch_tokens_total", n)):
        put(name, value)
    sum_r, max_a = at("sum_r"), at("max_a")
    put("mismatch_log_ratio_mean", _div(sum_r, n))
    put("mismatch_kl_k1", _div(-sum_r, n))
    put("mismatch_kl_k2", _div(0.5 * at("sum_r2"), n))
    put("mismatch_abs_log_ratio_mean", _div(at("sum_a"), n))
    put("mismatch_abs_log_ratio_max", max_a if n > 0 else None)
    put("mismatch_kl_k3", _div(at("sum_k3"), n))
    sum_em1, sq_em1 = at("sum_em1"), at("sq_em1")
    put("mismatch_chi2_token", _div(sq_em1 + 2 * sum_em1, n))
    put("is_ess_raw_ratio", _ess_ratio(sum_em1, sq_em1, n))
    put("is_ess_ratio", _ess_ratio(at("sum_em1t"), at("sq_em1t"), n))
    put("is_ratio_min", _ratio_of(-at("neg_min_r"), n))
    put("is_ratio_max", _ratio_of(at("max_r"), n))
    put("is_ratio_mean", _div(n + sum_em1, n))
    high, masked = at("high"), at("mis_below") + at("mis_above")
    put("is_tis_high_ratio", _div(high, n))
    put("is_tis_low_ratio", _div(at("low"), n))
    put("is_mis_masked_ratio", _div(masked, n))
    put("is_tis_truncated_tokens_total", high)
    put("is_mis_masked_tokens_total", masked)
    put("mismatch_log_ratio_slope", _apply(_slope, [[at("rs"), at("ss")], at("s_sum"), sum_r, n]))
    seq_n = at("seq_n")
    for name, field in (("mismatch_seq_log_ratio_abs_mean", "seq_abs"), ("mismatch_chi2_sequence", "seq_chi2"),
                        ("is_seq_tis_high_ratio", "seq_high"), ("is_seq_tis_low_ratio", "seq_low")):
        put(name, _div(at(field), seq_n))
    put("is_seq_mis_masked_ratio", _div(at("seq_mis_below") + at("seq_mis_above"), seq_n))
    put("mismatch_seq_log_ratio_abs_max", at("seq_max") if seq_n > 0 else None)
    for k, label in enumerate(PROB_BIN_LABELS):
        put("mismatch_abs_log_ratio_by_prob", _div(band_abs[k], band_tokens[k]), (label,))
        put("mismatch_tokens_by_prob", band_tokens[k], (label,))
    for name, field in (("mismatch_abs_log_ratio_p50", "q50"), ("mismatch_abs_log_ratio_p99", "q99")):
        put(name, min(at(field), max_a) if n > 0 and math.isfinite(at(field)) else None)


def _finish_lag(at: Callable[[str], float], lag_cum: list[float], put: Callable[..., None], out: Values) -> None:
    """The version-lag formulas from the fused vector's fields (``at``)."""
    n_ok, over, seq_n, spans = at("n_ok"), at("over"), at("lag_seq_n"), at("spans")
    lag_sum = fused.LAG_BINS * n_ok - at("cum_sum")
    put("negative_lag_tokens_total", at("tokens") - n_ok)
    put("version_lag_mean", _div(lag_sum, n_ok))
    put("version_lag_max", at("lag_max") if n_ok > 0 else None)
    put("version_lag_p99", at("lag_p99") if n_ok > 0 else math.nan)     # (lag_p50 is not exported)
    put("version_lag_over_bound_ratio", _div(over, n_ok))
    put("tokens_over_staleness_bound_total", over)
    put("version_lag_sequence_max_mean", _div(at("lag_seq_max_sum"), seq_n))
    put("partial_rollout_ratio", _div(spans, seq_n))
    put("partial_rollout_sequences_total", spans)
    rows = [(str(b),) for b in LAG_BUCKETS] + [("+Inf",)]
    out["token_version_lag"] = dict(zip(rows, _bucket_counts(lag_cum, n_ok)))
    put("token_version_lag_sum", lag_sum)


def compute_step(record: "StepRecord", config: SignalConfig, ws: Workspace | None = None) -> Values:
    """Every signal of one validated step, with exactly one host synchronisation.

    Returns ``{metric name: {label values: value}}`` using the names of :mod:`rlwatch.metrics`
    (gauges hold the step's value, counters the step's increment, the histogram its per-bucket
    counts). Names starting with ``_`` are internal checks, not exported. Runs in inference mode
    (no autograd bookkeeping on the few hundred small operations of a step).
    """
    with torch.inference_mode():
        return _compute_step(record, config, ws)


def _compute_step(record: "StepRecord", config: SignalConfig, ws: Workspace | None) -> Values:
    out = Pending()
    mask = record.mask
    episodes = EpisodeInputs(record, config)
    if not token_signals(out, record, config, ws, episodes):
        per_seq = mask.sum(-1)                                                 # [B] response lengths
        tokens = per_seq.sum()
        out.put("tokens", tokens)
        out.put("tokens_total", tokens)
        if record.trainer_logp is not None and record.sampler_logp is not None:
            mismatch_signals(out, record.trainer_logp, record.sampler_logp, mask, config, ws, tokens)
        if record.version is not None and record.trainer_version is not None:
            lag_signals(out, record.version, record.trainer_version, mask, config, ws, per_seq)
        # The episode signals: the same function as the fused engine's episode block, eagerly.
        vector = episode_core(per_seq, *episodes.tensors)
        out.host(episodes.finish, out.vector(vector))
    if record.entropy is not None:
        entropy_signal(out, record.entropy, mask)
    values = out.resolve()
    _put_record_values(values, record)
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
        failures = failure_counts(record.env, record.failed)
        episodes = values.get("env_episodes", {})
        values["episodes_failed_total"] = {k: float(v) for k, v in failures.items()}
        values["env_failure_ratio"] = {
            (e, kind): (count / episodes[(e,)] if episodes.get((e,)) else None)
            for (e, kind), count in failures.items()}
        # Kinds seen earlier but absent now are reported as 0 by the exporter state.


def compute(config: SignalConfig | None = None, **fields) -> Values:
    """Compute every signal of one step from plain tensors, without exporting anything.

    Takes the same fields as :meth:`rlwatch.Watch.observe` (``mask`` required, ``step`` optional)
    and raises :class:`~rlwatch.errors.InvalidFieldError` on a malformed field.
    """
    from ..errors import HookErrors
    from ..record import RecordBuilder

    config = config or SignalConfig()
    step = fields.pop("step", 0)
    builder = RecordBuilder(HookErrors(strict=True))
    ws = Workspace()
    record = builder.build(step, fields, ws)
    assert record is not None
    return compute_step(record, config, ws)
