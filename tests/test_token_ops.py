"""The fused token block (:func:`rlwatch.signals.fused.token_core`): a bounded number of eager
operations per step (each costs microseconds of dispatch on a tiny step), and every token signal
equal to a straightforward per-signal computation in plain torch (masked means, sorts, comparisons)
over random shapes, masks, non-finite log-probs, dtypes and version layouts, so that the fused
arithmetic (stacked rows, signed comparisons, host-side finishing) is pinned independently of it."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlwatch import SignalConfig, compute
from rlwatch.core.errors import HookErrors
from rlwatch.core.metrics import LAG_BUCKET_LABELS, LAG_BUCKETS, PROB_BIN_EDGES, PROB_BIN_LABELS
from rlwatch.core.record import RecordBuilder
from rlwatch.signals import Workspace, fused
from rlwatch.signals.step import engine_inputs

# Dispatched aten operations of one eager token_core at 8 x 64 (fp32 log-probs): 118 with per-token
# versions (2 of them the negative-version check, which the record no longer does in 3 over the
# whole step), 114 per-sequence, 115 (first, last); with the per-lag mismatch sums and every split by
# band and lag in one bincount; a little headroom.
MAX_TOKEN_CORE_OPS = 120


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _bench_like_step(B: int, T: int, layout: str) -> dict:
    """As bench/bench_signals.make_inputs: fp32 log-probs, a few short sequences, partial rollouts."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.full((B,), T)
    lengths[: B // 8] = torch.randint(T // 4, T, (B // 8,), generator=g)
    sampler = -torch.rand(B, T, generator=g) * 3
    switch = torch.randint(0, T, (B, 1), generator=g)
    start = 100 - torch.randint(0, 6, (B, 1), generator=g)
    version = torch.where(torch.arange(T)[None] < switch, start, start + 1).clamp(max=100)
    fields = dict(mask=torch.arange(T)[None, :] < lengths[:, None], sampler_logp=sampler,
                  trainer_logp=sampler + 0.05 * torch.randn(B, T, generator=g), trainer_version=100)
    if layout == "token":
        fields["token_version"] = version
    else:
        fields["seq_version"] = version[:, 0] if layout == "seq" else torch.stack([version[:, 0], version[:, -1]], 1)
    return fields


@pytest.mark.perf
@pytest.mark.parametrize("layout", ["token", "seq", "pair"])
def test_eager_token_core_operation_count_is_bounded(layout):
    fields = _bench_like_step(8, 64, layout)
    record = RecordBuilder(HookErrors(strict=True)).build(0, fields, Workspace(compile="never"))
    args, exact = engine_inputs(record, SignalConfig())
    with torch.inference_mode():
        fused.token_core(*args[:-1], exact_quantiles=exact, over_from=args[-1])      # constants cached
        counter = _CountOps()
        with counter:
            fused.token_core(*args[:-1], exact_quantiles=exact, over_from=args[-1])
    total = sum(counter.ops.values())
    assert total <= MAX_TOKEN_CORE_OPS, (total, counter.ops.most_common(12))


# --- every token signal against a plain per-signal reference --------------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _random_step(seed: int) -> tuple[dict, SignalConfig]:
    g = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 13, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    dtype = DTYPES[seed % len(DTYPES)]
    mask = torch.rand(B, T, generator=g) < (0.0, 0.5, 0.9, 1.0)[seed // 4 % 4]
    sampler = -torch.rand(B, T, generator=g) * 4
    trainer = sampler + (0.0, 0.05, 1.0, 30.0)[seed // 16 % 4] * torch.randn(B, T, generator=g)
    for t in (sampler, trainer):
        holes = torch.rand(B, T, generator=g) < 0.1 * (seed % 3 == 0)
        t[holes] = (float("nan"), float("inf"), float("-inf"))[seed % 3]
    fields = dict(mask=mask, sampler_logp=sampler.to(dtype), trainer_logp=trainer.to(dtype), trainer_version=50)
    # Lags -1 .. 9 (a version one ahead of the trainer: a negative lag, counted and excluded).
    start = 50 - torch.randint(-1, 9, (B,), generator=g)
    layout = ("token", "seq", "pair")[seed % 3]
    if layout == "token":
        switch = torch.randint(0, T + 1, (B, 1), generator=g)
        fields["token_version"] = torch.where(torch.arange(T)[None] < switch, start[:, None],
                                              (start[:, None] + 1).clamp(max=51))
    elif layout == "seq":
        fields["seq_version"] = start
    else:
        fields["seq_version"] = torch.stack([start, (start + torch.randint(0, 2, (B,), generator=g)).clamp(max=51)], 1)
    cap = (2.0, 1.5, 3.0)[seed % 3]
    return fields, SignalConfig(is_cap=cap, mis_band=(0.5, (5.0, 2.0)[seed % 2]), staleness_bound=(4.0, 2.5)[seed % 2])


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def _reference(fields: dict, config: SignalConfig) -> dict:
    """Each token signal computed on its own, in float64, from its definition."""
    mask = fields["mask"]
    trainer, sampler = fields["trainer_logp"], fields["sampler_logp"]
    work = torch.float64 if trainer.dtype == torch.float64 else torch.float32
    r_all = (trainer.to(work) - sampler.to(work)).double()
    valid = mask & torch.isfinite(r_all)
    r, s = r_all[valid], sampler.to(work).double()[valid]
    n = int(valid.sum())
    w = r.clamp(-20, 20).exp()
    wt = w.clamp(max=config.is_cap)
    low, high = config.mis_band
    out: dict = {"tokens": float(mask.sum()), "nonfinite_tokens": float((mask & ~torch.isfinite(r_all)).sum()),
                 "mismatch_tokens": float(n)}

    def mean(x):
        return float(x.sum()) / n if n else None

    out.update(mismatch_log_ratio_mean=mean(r), mismatch_kl_k1=mean(-r), mismatch_kl_k2=mean(0.5 * r * r),
               mismatch_kl_k3=mean(w - 1 - r), mismatch_abs_log_ratio_mean=mean(r.abs()),
               mismatch_abs_log_ratio_max=float(r.abs().max()) if n else None, mismatch_chi2_token=mean(w * w - 1),
               is_ratio_min=float(w.min()) if n else None, is_ratio_max=float(w.max()) if n else None,
               is_ratio_mean=mean(w), is_tis_high_ratio=mean((w > config.is_cap).double()),
               is_tis_low_ratio=mean((w < 1 / config.is_cap).double()),
               is_mis_masked_ratio=mean(((w < low) | (w > high)).double()),
               is_tis_truncated_tokens_total=float((w > config.is_cap).sum()),
               is_mis_masked_tokens_total=float(((w < low) | (w > high)).sum()))
    out["is_ess_raw_ratio"] = min(float(w.sum()) ** 2 / (n * float((w * w).sum())), 1.0) if n else None
    out["is_ess_ratio"] = min(float(wt.sum()) ** 2 / (n * float((wt * wt).sum())), 1.0) if n else None
    var_s = n * float((s * s).sum()) - float(s.sum()) ** 2
    out["mismatch_log_ratio_slope"] = ((n * float((r * s).sum()) - float(s.sum()) * float(r.sum())) / var_s
                                       if n and var_s > 1e-9 * n * n else None)
    qs = torch.quantile(r.abs(), torch.tensor([0.5, 0.99], dtype=torch.float64)) if n else None
    out["mismatch_abs_log_ratio_p50"] = float(qs[0]) if n else None
    out["mismatch_abs_log_ratio_p99"] = float(qs[1]) if n else None
    # Sequences with a valid token: s_b = sum of their r.
    seq = torch.where(valid, r_all, 0.0).sum(-1)[valid.any(-1)]
    n_seq, sw = seq.numel(), seq.clamp(-20, 20).exp()
    out.update(mismatch_seq_log_ratio_abs_mean=_div(float(seq.abs().sum()), n_seq),
               mismatch_chi2_sequence=_div(float((sw * sw - 1).sum()), n_seq),
               is_seq_tis_high_ratio=_div(float((sw > config.is_cap).sum()), n_seq),
               is_seq_tis_low_ratio=_div(float((sw < 1 / config.is_cap).sum()), n_seq),
               is_seq_mis_masked_ratio=_div(float(((sw < low) | (sw > high)).sum()), n_seq),
               mismatch_seq_log_ratio_abs_max=float(seq.abs().max()) if n_seq else None)
    prob = s.exp()
    edges = (0.0, *PROB_BIN_EDGES, math.inf)
    for k, label in enumerate(PROB_BIN_LABELS):
        in_bin = (prob >= edges[k]) & (prob < edges[k + 1])
        out[("mismatch_abs_log_ratio_by_prob", label)] = _div(float(r.abs()[in_bin].sum()), float(in_bin.sum()))
        out[("mismatch_tokens_by_prob", label)] = float(in_bin.sum())
    # Version lag: per token, [B] and [B, 2] versions stamp every token of a sequence with its first.
    version = fields.get("token_version", fields.get("seq_version"))
    B, T = mask.shape
    first = version[:, 0] if version.dim() == 2 else version
    per_token = version if version.shape == mask.shape else first[:, None].expand(B, T)
    lag_all = (50 - per_token).double()
    lag = lag_all[mask]
    ok = lag[lag >= 0]
    n_ok = ok.numel()
    out.update(negative_lag_tokens_total=float((lag < 0).sum()), version_lag_mean=_div(float(ok.sum()), n_ok),
               version_lag_max=float(ok.max()) if n_ok else None,
               version_lag_p99=float(torch.quantile(ok, 0.99)) if n_ok else None,
               version_lag_over_bound_ratio=_div(float((ok > config.staleness_bound).sum()), n_ok),
               tokens_over_staleness_bound_total=float((ok > config.staleness_bound).sum()),
               token_version_lag_sum=float(ok.sum()))
    has = mask.any(-1)
    seq_max = torch.where(mask, lag_all, -math.inf).amax(-1)[has].clamp_min(0)
    out["version_lag_sequence_max_mean"] = _div(float(seq_max.sum()), int(has.sum()))
    if version.shape == mask.shape:
        spans = (torch.where(mask, per_token, -1).amax(-1) != torch.where(mask, per_token, 10**6).amin(-1)) & has
    elif version.dim() == 2:
        spans = (version[:, 0] != version[:, 1]) & has
    else:
        spans = torch.zeros(B, dtype=torch.bool)
    out["partial_rollout_ratio"] = _div(float(spans.sum()), int(has.sum()))
    out["partial_rollout_sequences_total"] = float(spans.sum())
    previous = -1
    for bound in LAG_BUCKETS:
        out[("token_version_lag", str(bound))] = float(((ok > previous) & (ok <= bound)).sum())
        previous = bound
    out[("token_version_lag", "+Inf")] = float((ok > previous).sum())
    # Mismatch by lag bucket: the valid tokens of non-negative lag in each histogram bucket.
    token_lag = lag_all[valid]
    previous = -1
    for bound, label in zip((*LAG_BUCKETS, math.inf), LAG_BUCKET_LABELS):
        inside = (token_lag > previous) & (token_lag <= bound)
        count = int(inside.sum())
        out[("mismatch_tokens_by_lag", label)] = float(count)
        out[("mismatch_kl_k3_by_lag", label)] = _div(float((w - 1 - r)[inside].sum()), count)
        out[("mismatch_abs_log_ratio_mean_by_lag", label)] = _div(float(r.abs()[inside].sum()), count)
        previous = bound
    return out


def _close(x, y, name) -> bool:
    if x is None or y is None:
        return x is None and y is None
    rel, abs_ = (1e-3, 1e-3) if name == "mismatch_log_ratio_slope" else (1e-4, 1e-5)
    return math.isclose(x, y, rel_tol=rel, abs_tol=abs_)


@pytest.mark.parametrize("seed", range(96))
def test_token_signals_equal_a_plain_per_signal_reference(seed):
    fields, config = _random_step(seed)
    values = compute(config, **fields)              # small steps: the fused eager token block
    expected = _reference(fields, config)
    wrong = []
    for key, want in expected.items():
        name, labels = (key, ()) if isinstance(key, str) else (key[0], key[1:])
        got = values[name][labels]
        if not _close(got, want, name):
            wrong.append((name, labels, got, want))
    assert not wrong, (fields["trainer_logp"].dtype, fields["mask"].shape, wrong)


def _assert_shift_changes_nothing(fields: dict, config: SignalConfig, offset: int) -> None:
    """The same step with every version and the trainer version ``offset`` larger (the same lags) has
    the same values, but for the trainer version itself."""
    shifted = dict(fields, trainer_version=fields["trainer_version"] + offset)
    for key in ("token_version", "seq_version"):
        if key in fields:
            shifted[key] = fields[key] + offset
    expected = compute(config, **fields)
    expected["trainer_version"] = {(): float(fields["trainer_version"] + offset)}
    assert compute(config, **shifted) == expected


# Around 2**24 the engine moves from float32 lags (every version up to trainer_version + 1 a float32
# exactly) to float64 ones; far above it only float64 holds the versions.
@pytest.mark.parametrize("offset", [2 ** 24 - 52, 2 ** 24 - 51, 2 ** 24 + 3, 2 ** 40])
@pytest.mark.parametrize("seed", [0, 1, 2, 5, 13, 22, 40, 61])
def test_version_signals_do_not_depend_on_where_the_versions_are(seed, offset):
    _assert_shift_changes_nothing(*_random_step(seed), offset)


@pytest.mark.parametrize("offset", [2 ** 24 + 3, 2 ** 40])
def test_version_signals_of_a_large_step_do_not_depend_on_where_the_versions_are(offset):
    """A step of several chunks, each too large to stack (:func:`rlwatch.signals.fused._direct_sums`)."""
    _assert_shift_changes_nothing(_bench_like_step(160, 2048, "token"), SignalConfig(), offset)
