"""The signal math: hand-computed cases, invariances, estimator identities, statistics."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlwatch
from rlwatch import InvalidFieldError, SignalConfig, compute
from rlwatch.core.metrics import CATALOGUE, LAG_BUCKETS, PROB_BIN_LABELS
from rlwatch.core.record import RecordBuilder
from rlwatch.core.errors import HookErrors
from rlwatch import signals
from rlwatch.signals import Pending, Workspace, compute_step

from tests.conftest import host_reads, make_step


@contextlib.contextmanager
def histogram_quantiles():
    """|r| quantiles from the histogram, as on steps of more than EXACT_QUANTILE_MAX_TOKENS positions."""
    saved, signals.settings.EXACT_QUANTILE_MAX_TOKENS = signals.settings.EXACT_QUANTILE_MAX_TOKENS, 0
    try:
        yield
    finally:
        signals.settings.EXACT_QUANTILE_MAX_TOKENS = saved


def scalar(values, name, labels=()):
    return values[name][tuple(labels)]


def test_hand_computed_mismatch():
    # Two sequences, r = trainer - sampler on the masked tokens: [0.5, -0.5] and [1.0] (third token padding).
    sampler = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-0.5, -2.5, 7.0], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    v = compute(mask=mask, sampler_logp=sampler, trainer_logp=trainer)
    r = torch.tensor([0.5, -0.5, 1.0], dtype=torch.float64)
    w = r.exp()
    assert scalar(v, "mismatch_tokens") == 3
    assert scalar(v, "mismatch_kl_k1") == pytest.approx(float(-r.mean()), abs=1e-7)
    assert scalar(v, "mismatch_kl_k2") == pytest.approx(float((r * r / 2).mean()), abs=1e-7)
    assert scalar(v, "mismatch_kl_k3") == pytest.approx(float((w - 1 - r).mean()), rel=1e-6)
    assert scalar(v, "mismatch_chi2_token") == pytest.approx(float((w * w).mean() - 1), rel=1e-6)
    assert scalar(v, "mismatch_log_ratio_mean") == pytest.approx(float(r.mean()), abs=1e-7)
    assert scalar(v, "mismatch_abs_log_ratio_mean") == pytest.approx(2 / 3, rel=1e-6)
    assert scalar(v, "mismatch_abs_log_ratio_max") == pytest.approx(1.0)
    assert scalar(v, "mismatch_abs_log_ratio_p50") == pytest.approx(0.5, rel=3e-3)
    # TIS cap 2: only w = e^1 = 2.718 exceeds it; w = e^-0.5 = 0.61 is above 1/2; MIS band [0.5, 5]: none.
    assert scalar(v, "is_tis_high_ratio") == pytest.approx(1 / 3)
    assert scalar(v, "is_tis_low_ratio") == 0
    assert scalar(v, "is_mis_masked_ratio") == 0
    wt = w.clamp(max=2.0)
    assert scalar(v, "is_ess_ratio") == pytest.approx(float(wt.sum() ** 2 / (3 * (wt * wt).sum())), rel=1e-6)
    assert scalar(v, "is_ess_raw_ratio") == pytest.approx(float(w.sum() ** 2 / (3 * (w * w).sum())), rel=1e-6)
    # Sequence sums: 0.0 and 1.0.
    assert scalar(v, "mismatch_seq_log_ratio_abs_mean") == pytest.approx(0.5, abs=1e-7)
    assert scalar(v, "mismatch_seq_log_ratio_abs_max") == pytest.approx(1.0)
    assert scalar(v, "mismatch_chi2_sequence") == pytest.approx((1 + math.exp(2)) / 2 - 1, rel=1e-6)
    assert scalar(v, "is_seq_tis_high_ratio") == pytest.approx(0.5)
    # Sampler probabilities: e^-1 = 0.37 and e^-2 = 0.14 fall in [0.1, 0.5), e^-0.5 = 0.61 in [0.5, 0.9).
    by_prob = v["mismatch_tokens_by_prob"]
    assert [by_prob[(label,)] for label in PROB_BIN_LABELS] == [0, 2, 1, 0]
    assert v["mismatch_abs_log_ratio_by_prob"][("0.1-0.5",)] == pytest.approx(0.5)
    assert v["mismatch_abs_log_ratio_by_prob"][("0.0-0.1",)] is None


def test_padding_invariance_even_with_garbage_in_padding():
    step = make_step(B=8, T=16, seed=3)
    base = compute(**step)
    padded = dict(step)
    extra = 5
    pad = lambda t, value: torch.cat([t, torch.full((t.shape[0], extra), value, dtype=t.dtype)], 1)  # noqa: E731
    padded["mask"] = pad(step["mask"], False)
    padded["sampler_logp"] = pad(step["sampler_logp"], float("-inf"))
    padded["trainer_logp"] = pad(step["trainer_logp"], float("nan"))
    padded["token_version"] = pad(step["token_version"], 10_000)
    other = compute(**padded)
    for name, family in base.items():
        if name.startswith("_"):
            continue
        for labels, value in family.items():
            if value is None:
                assert other[name][labels] is None, name
            else:
                assert other[name][labels] == pytest.approx(value, rel=1e-6, abs=1e-9), (name, labels)


@pytest.mark.parametrize("binned", [False, True], ids=["exact", "histogram"])
def test_nonfinite_tokens_are_counted_and_excluded(binned):
    with histogram_quantiles() if binned else contextlib.nullcontext():
        _check_nonfinite_tokens_are_counted_and_excluded()


def _check_nonfinite_tokens_are_counted_and_excluded():
    step = make_step(B=6, T=10, seed=1)
    mask = step["mask"]
    poisoned = dict(step)
    sampler = step["sampler_logp"].clone()
    trainer = step["trainer_logp"].clone()
    sampler[0, 0] = float("-inf")     # top-p masked token
    trainer[1, 0] = float("nan")       # a kernel NaN
    poisoned["sampler_logp"], poisoned["trainer_logp"] = sampler, trainer
    v = compute(**poisoned)
    assert scalar(v, "nonfinite_tokens") == 2
    reference_mask = mask.clone()
    reference_mask[0, 0] = reference_mask[1, 0] = False
    ref = compute(mask=reference_mask, sampler_logp=step["sampler_logp"], trainer_logp=step["trainer_logp"])
    for name in ("mismatch_kl_k1", "mismatch_kl_k3", "mismatch_chi2_token", "mismatch_abs_log_ratio_max",
                 "is_ess_ratio", "is_tis_high_ratio", "mismatch_abs_log_ratio_p99"):
        assert scalar(v, name) == pytest.approx(scalar(ref, name), rel=1e-6), name
        assert math.isfinite(scalar(v, name))


@pytest.mark.parametrize("binned", [False, True], ids=["exact", "histogram"])
def test_all_masked_batch_gives_absent_ratios_not_nan(binned):
    step = make_step(B=4, T=8)
    step["mask"] = torch.zeros(4, 8, dtype=torch.bool)
    with histogram_quantiles() if binned else contextlib.nullcontext():
        v = compute(**step)
    assert scalar(v, "tokens") == 0
    for name in ("mismatch_kl_k3", "is_ess_ratio", "version_lag_mean", "mismatch_abs_log_ratio_p99"):
        assert scalar(v, name) is None, name


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 12), T=st.integers(1, 40), seed=st.integers(0, 10_000),
       scale=st.sampled_from([1e-6, 1e-3, 0.05, 0.5, 3.0]), cap=st.sampled_from([1.5, 2.0, 3.0]))
def test_estimator_identities(B, T, seed, scale, cap):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    sampler = -torch.rand(B, T, generator=g) * 4
    trainer = sampler + scale * torch.randn(B, T, generator=g)
    v = compute(SignalConfig(is_cap=cap), mask=mask, sampler_logp=sampler, trainer_logp=trainer)
    n = int(mask.sum())
    if n == 0:
        assert scalar(v, "mismatch_kl_k3") is None
        return
    r = (trainer - sampler)[mask].double()
    assert scalar(v, "mismatch_kl_k3") >= 0
    assert scalar(v, "mismatch_kl_k2") >= 0
    assert 0 < scalar(v, "is_ess_ratio") <= 1 + 1e-9
    assert 0 < scalar(v, "is_ess_raw_ratio") <= 1 + 1e-9
    # TIS and MIS fractions equal direct counts on the float32 weights.
    w32 = (trainer - sampler)[mask].exp()
    assert scalar(v, "is_tis_high_ratio") * n == pytest.approx(float((w32 > cap).sum()), abs=1e-6)
    assert scalar(v, "is_tis_low_ratio") * n == pytest.approx(float((w32 < 1 / cap).sum()), abs=1e-6)
    assert scalar(v, "is_mis_masked_ratio") * n == pytest.approx(float(((w32 < 0.5) | (w32 > 5)).sum()), abs=1e-6)
    assert scalar(v, "mismatch_kl_k1") == pytest.approx(float(-r.mean()), abs=1e-6 + 1e-6 * float(r.abs().mean()))
    # float32 resolves expm1(r) - r to about 1.2e-7 |r| per token.
    assert scalar(v, "mismatch_kl_k3") == pytest.approx(float((torch.expm1(r) - r).mean()), rel=1e-4,
                                                       abs=1.2e-7 * float(r.abs().mean()) + 1e-30)
    # |r| quantiles: exact on a step this small, within a histogram bin (0.2%) on large steps.
    exact = torch.quantile((trainer - sampler)[mask].abs().double(), torch.tensor([0.5, 0.99], dtype=torch.float64))
    with histogram_quantiles():
        binned = compute(SignalConfig(is_cap=cap), mask=mask, sampler_logp=sampler, trainer_logp=trainer)
    for values, rel in ((v, 1e-12), (binned, 4e-3)):
        p50, p99, top = (scalar(values, k) for k in ("mismatch_abs_log_ratio_p50", "mismatch_abs_log_ratio_p99",
                                                     "mismatch_abs_log_ratio_max"))
        assert p50 <= p99 + 1e-12 <= top + 2e-12
        assert p50 == pytest.approx(float(exact[0]), rel=rel, abs=1e-30)
        assert p99 == pytest.approx(float(exact[1]), rel=rel, abs=1e-30)


def test_ties_at_the_cap_are_not_counted_as_above():
    # A sampler that reports log-probs at the wrong temperature can give ratios of exactly 2.0 (trl#4159).
    sampler = torch.full((4, 8), math.log(0.25))
    trainer = torch.full((4, 8), math.log(0.5))   # w = 2 exactly in float32
    mask = torch.ones(4, 8, dtype=torch.bool)
    v = compute(mask=mask, sampler_logp=sampler, trainer_logp=trainer)
    w = (trainer - sampler).exp()
    assert scalar(v, "is_tis_high_ratio") == float((w > 2).float().mean())


def test_k1_and_k3_recover_a_known_kl():
    """Tokens drawn from mu: mean(-r) and mean(w - 1 - r) estimate KL(mu || pi) on a softmax problem."""
    g = torch.Generator().manual_seed(0)
    V, N = 50, 400_000
    logpi = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    logmu = torch.log_softmax(logpi + 0.4 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    kl = float((logmu.exp() * (logmu - logpi)).sum())
    tokens = torch.multinomial(logmu.exp(), N, replacement=True, generator=g)
    sampler, trainer = logmu[tokens].view(400, 1000), logpi[tokens].view(400, 1000)
    v = compute(mask=torch.ones(400, 1000, dtype=torch.bool), sampler_logp=sampler, trainer_logp=trainer)
    r = trainer - sampler
    se_k1 = float(r.std()) / math.sqrt(N)
    se_k3 = float((r.exp() - 1 - r).std()) / math.sqrt(N)
    assert abs(scalar(v, "mismatch_kl_k1") - kl) < 4 * se_k1
    assert abs(scalar(v, "mismatch_kl_k3") - kl) < 4 * se_k3
    assert kl > 0.02


def _direct_lag(mask, version, trainer_version, bound):
    lag = (trainer_version - version)[mask].double()
    return dict(mean=float(lag.mean()), max=float(lag.max()), p99=float(torch.quantile(lag, 0.99)),
                over=float((lag > bound).double().mean()))


@pytest.mark.parametrize("form", ["token", "seq", "start_end"])
def test_version_lag_matches_direct_computation(form):
    g = torch.Generator().manual_seed(7)
    B, T, tv = 12, 20, 30
    mask = torch.rand(B, T, generator=g) < 0.8
    start = tv - torch.randint(0, 12, (B,), generator=g)
    if form == "token":
        switch = torch.randint(0, T, (B, 1), generator=g)
        token_version = torch.where(torch.arange(T)[None] < switch, start[:, None], (start[:, None] + 1).clamp(max=tv))
        field = dict(token_version=token_version)
        per_token = token_version
    elif form == "seq":
        field = dict(seq_version=start)
        per_token = start[:, None].expand(B, T)
    else:
        field = dict(token_version=torch.stack([start, (start + 1).clamp(max=tv)], 1))
        per_token = start[:, None].expand(B, T)   # [B, 2]: the first version, an upper bound on the lag
    v = compute(SignalConfig(staleness_bound=4), mask=mask, trainer_version=tv, **field)
    direct = _direct_lag(mask, per_token, tv, 4)
    assert scalar(v, "version_lag_mean") == pytest.approx(direct["mean"])
    assert scalar(v, "version_lag_max") == direct["max"]
    assert scalar(v, "version_lag_p99") == pytest.approx(direct["p99"])
    assert scalar(v, "version_lag_over_bound_ratio") == pytest.approx(direct["over"])
    lag = (tv - per_token)[mask]
    buckets = v["token_version_lag"]
    assert sum(buckets.values()) == int(mask.sum())
    previous = -1
    for bound in LAG_BUCKETS:
        assert buckets[(str(bound),)] == int(((lag > previous) & (lag <= bound)).sum())
        previous = bound
    if form in ("token", "start_end"):
        has = mask.any(1)
        if form == "token":
            tv_masked = torch.where(mask, token_version, -1)
            spans = (tv_masked.amax(1) != torch.where(mask, token_version, 10**6).amin(1)) & has
        else:
            spans = ((start + 1).clamp(max=tv) != start) & has
        assert scalar(v, "partial_rollout_ratio") == pytest.approx(float(spans.sum() / has.sum()))
    else:
        assert scalar(v, "partial_rollout_ratio") == 0


def test_negative_lag_is_counted_and_excluded():
    mask = torch.ones(2, 4, dtype=torch.bool)
    version = torch.tensor([[5, 5, 5, 5], [12, 12, 3, 3]])
    v = compute(mask=mask, token_version=version, trainer_version=10)
    assert scalar(v, "negative_lag_tokens_total") == 2
    assert scalar(v, "version_lag_max") == 7
    assert scalar(v, "version_lag_mean") == pytest.approx((5 * 4 + 7 * 2) / 6)


@pytest.mark.parametrize("chunked", [False, True], ids=["one_pass", "chunked"])
def test_negative_integer_versions_are_no_version_as_float_ones(chunked, monkeypatch):
    # Per-token integer versions reach the lag block unchecked (the record checks floats and the
    # per-sequence layouts): a negative one counts as a negative lag, as a future one does.
    if chunked:
        monkeypatch.setattr(signals.settings, "FUSED_CHUNK_TOKENS", 4)
        monkeypatch.setattr(signals.settings, "STACK_MAX_TOKENS", 0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    version = torch.tensor([[5, 5, -3, 5], [12, -1, 3, -7]])
    values = {dtype: compute(mask=mask, token_version=version.to(dtype), trainer_version=10)
              for dtype in (torch.int64, torch.int32, torch.float64)}
    for v in values.values():
        assert scalar(v, "negative_lag_tokens_total") == 3               # -3, 12, -1 (-7 is off the mask)
        assert scalar(v, "version_lag_max") == 7
        assert scalar(v, "version_lag_mean") == pytest.approx((5 * 3 + 7) / 4)
        assert scalar(v, "partial_rollout_ratio") == 1.0       # no version stamps one newer: both rows span
    assert values[torch.int64] == values[torch.int32] == values[torch.float64]


def test_zero_variance_groups_by_kind():
    rewards = torch.tensor([1., 1., 1., 1., 0., 0., 0., 0., 0.5, 0.5, 0.5, 0.5, 1., 0., 1., 0.])
    groups = torch.arange(16) // 4
    mask = torch.ones(16, 3, dtype=torch.bool)
    v = compute(mask=mask, rewards=rewards, group_ids=groups)
    assert scalar(v, "groups") == 4
    assert v["zero_variance_groups_ratio"] == {("all_pass",): 0.25, ("all_fail",): 0.25, ("constant",): 0.25}
    assert scalar(v, "zero_gradient_episodes_ratio") == 0.75
    # An infrastructure failure is not a reward: the failed episode leaves the last group all-pass.
    failed = [None] * 13 + ["timeout", None, "timeout"]
    v = compute(mask=mask, rewards=rewards, group_ids=groups, failed=failed, env=["e"] * 16)
    assert v["zero_variance_groups_ratio"][("all_pass",)] == 0.5
    assert scalar(v, "reward_mean") == pytest.approx(float(rewards[:13].sum() + rewards[14]) / 14)
    assert v["env_failure_ratio"][("e", "timeout")] == pytest.approx(2 / 16)
    # Per environment, a group is judged on its episodes that did not fail, whichever episode failed.
    for order in (torch.arange(16), torch.arange(15, -1, -1)):
        v = compute(mask=mask, rewards=rewards[order], group_ids=groups[order], env=["e"] * 16,
                    failed=[failed[i] for i in order.tolist()])
        assert v["env_zero_variance_groups_ratio"] == {("e",): 1.0}


def test_string_group_ids_and_explicit_reward_bounds():
    mask = torch.ones(4, 2, dtype=torch.bool)
    v = compute(SignalConfig(reward_bounds=(0.0, 1.0)), mask=mask, rewards=[1.0, 1.0, 1.0, 1.0],
                group_ids=["uid-a", "uid-a", "uid-b", "uid-b"])
    assert scalar(v, "groups") == 2
    assert v["zero_variance_groups_ratio"][("all_pass",)] == 1.0


def test_lengths_and_truncation():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    v = compute(mask=mask, truncated=[False, False, True])
    lengths = torch.tensor([3.0, 1.0, 4.0])
    assert scalar(v, "response_length_mean") == pytest.approx(8 / 3)
    assert scalar(v, "response_length_max") == 4
    assert scalar(v, "response_length_p99") == pytest.approx(float(torch.quantile(lengths, 0.99)))
    assert scalar(v, "response_length_p95") == pytest.approx(float(torch.quantile(lengths, 0.95)))
    assert scalar(v, "truncated_ratio") == pytest.approx(1 / 3)


def test_per_environment_signals_and_label_cap():
    B = 8
    mask = torch.ones(B, 2, dtype=torch.bool)
    rewards = torch.tensor([1., 0., 1., 1., 0., 0., 1., 0.])
    env = ["a", "b"] * 4
    hacked = {"verifier": torch.tensor([1, 0, 1, 0, 0, 0, 0, 0], dtype=torch.bool)}
    v = compute(mask=mask, rewards=rewards, env=env, hacked=hacked, truncated=[True] + [False] * 7)
    assert v["env_episodes"] == {("a",): 4, ("b",): 4}
    assert v["env_reward_mean"][("a",)] == pytest.approx(0.75)
    assert v["env_reward_mean"][("b",)] == pytest.approx(0.25)
    assert v["env_hack_ratio"][("a", "verifier")] == 0.5
    assert v["env_hack_ratio"][("b", "verifier")] == 0.0
    assert v["env_truncated_ratio"][("a",)] == 0.25
    errors = HookErrors()
    builder = RecordBuilder(errors, env_cap=2)
    rec = builder.build(0, dict(mask=mask, env=[f"env{i}" for i in range(B)]))
    values = compute_step(rec, SignalConfig())
    assert set(values["env_episodes"]) == {("env0",), ("env1",), ("other",)}
    assert values["env_episodes"][("other",)] == 6
    assert errors.counts[("validate", "label_cap")] == 1


def test_strict_mode_names_the_bad_field():
    step = make_step(B=4, T=8)
    step["trainer_logp"] = torch.zeros(4, 7)
    with pytest.raises(InvalidFieldError) as info:
        compute(**step)
    assert info.value.field == "trainer_logp"
    assert info.value.kind == "shape"


def test_one_host_synchronisation_per_step(monkeypatch):
    """compute_step moves data to the host exactly once (Pending.resolve's tolist)."""
    step = make_step(B=8, T=16)
    step.update(entropy=torch.rand(8, 16), hacked={"d": torch.zeros(8, dtype=torch.bool)})
    builder = RecordBuilder(HookErrors(strict=True))
    ws = Workspace()
    record = builder.build(0, step, ws)
    calls = host_reads(monkeypatch)
    compute_step(record, SignalConfig(), ws)
    monkeypatch.undo()
    assert calls == ["tolist"], calls


def test_every_signal_is_in_the_catalogue():
    step = make_step(B=8, T=16)
    step.update(entropy=torch.rand(8, 16), hacked={"d": torch.zeros(8, dtype=torch.bool)},
                failed=[None] * 7 + ["crash"], temperature=1.0, top_p=0.9, top_k=-1, logprobs_mode="raw")
    v = compute(**step)
    names = {spec.name for spec in CATALOGUE}
    extra = {n for n in v if not n.startswith("_")} - names - {"token_version_lag_sum"}
    assert not extra, extra


def test_pending_finishes_formulas_on_the_host_with_one_transfer():
    out = Pending()
    out.derive("count", lambda x: x, torch.tensor(3))
    out.ratio("mean", torch.tensor(6.0), torch.tensor(3.0, dtype=torch.float64))
    out.ratio("empty", torch.tensor(0.0), torch.tensor(0.0))
    out.derive("max_if_any", lambda m, n: m if n > 0 else None, torch.tensor(2.5), torch.tensor(0.0))
    out.derive("nan", lambda x: x, torch.tensor(float("nan")))
    out.host(lambda v: {"per_row": {("a",): v[0] / 2, ("b",): v[1] / 2}}, out.vector(torch.tensor([[1.0, 3.0]])))
    assert out.resolve() == {"count": {(): 3.0}, "mean": {(): 2.0}, "empty": {(): None}, "max_if_any": {(): None},
                             "nan": {(): None}, "per_row": {("a",): 0.5, ("b",): 1.5}}


def test_mismatch_by_lag_is_in_the_step_values_the_store_and_the_exposition(tmp_path):
    """Per-token versions: lag 0 tokens in sync, lag 3 ones with a shifted log-prob; each bucket's k3
    and |r| are its own tokens' (from the definition), exported with a ``lag`` label and stored."""
    from prometheus_client import generate_latest

    from rlwatch.runs.store_reader import StoreReader

    mask = torch.ones(4, 8, dtype=torch.bool)
    sampler = -torch.rand(4, 8, generator=torch.Generator().manual_seed(0))
    stale = torch.arange(8)[None, :].expand(4, 8) >= 5
    trainer = torch.where(stale, sampler + 0.3, sampler)
    fields = dict(mask=mask, sampler_logp=sampler, trainer_logp=trainer, trainer_version=10,
                  token_version=torch.where(stale, 7, 10))
    k3 = math.exp(0.3) - 1 - 0.3
    path = str(tmp_path / "s.db")
    with rlwatch.Watch(run="bylag", port=None, store=path, alerts=False) as watch:
        values = watch.observe(0, **fields)
        text = generate_latest(watch.registry).decode()
    assert values.value("mismatch_tokens_by_lag", ("0",)) == 20.0
    assert values.value("mismatch_tokens_by_lag", ("3",)) == 12.0
    assert values.value("mismatch_kl_k3_by_lag", ("0",)) == pytest.approx(0.0, abs=1e-7)
    assert values.value("mismatch_kl_k3_by_lag", ("3",)) == pytest.approx(k3, rel=1e-5)
    assert values.value("mismatch_abs_log_ratio_mean_by_lag", ("3",)) == pytest.approx(0.3, rel=1e-5)
    assert values.value("mismatch_kl_k3_by_lag", ("1",)) is None                  # a bucket without tokens
    me = f'lag="3",run="bylag",run_instance="{watch.run_instance}"'
    assert f'rlwatch_mismatch_tokens_by_lag{{{me}}} 12.0' in text
    assert f'rlwatch_mismatch_kl_k3_by_lag{{{me}}}' in text
    with StoreReader(path) as store:
        row = next(iter(store.steps("bylag")))
    assert row.get("mismatch_kl_k3_by_lag", ("3",)) == pytest.approx(k3, rel=1e-5)
    assert row.get("mismatch_tokens_by_lag", ("0",)) == 20.0


def test_catalogue_levels_are_the_levels_the_engine_computes():
    """MetricSpec.level (which TRL's per-generation families are derived from) agrees with the engine:
    the declared token quantities are token- or sequence-level, and the families that only episode
    inputs produce are episode-level, every episode-level family among them (TRL's generation
    serials aside)."""
    from rlwatch.core.metrics import BY_NAME
    from rlwatch.signals import quantities

    assert {BY_NAME[m.name].level for m in quantities.METRICS if m.name in BY_NAME} == {"token", "sequence"}
    assert {BY_NAME[m.name].level for m in quantities.EPISODE_METRICS if m.name in BY_NAME} == {"episode"}
    token_fields = make_step(B=8, T=16)
    g = torch.Generator().manual_seed(0)
    full = dict(token_fields, rewards=torch.randint(0, 2, (8,), generator=g).float(), group_ids=torch.arange(8) // 2,
                env=["math", "code"] * 4, truncated=torch.rand(8, generator=g) < 0.5,
                hacked={"d": torch.rand(8, generator=g) < 0.5}, failed=[None] * 7 + ["crash"],
                durations=torch.rand(8, generator=g) * 100, dropped_reasons=["timeout", "stale"],
                dropped_durations=[300.0, 20.0], dropped_lengths=[16, 3])
    everything = {n for n in compute(**full) if not n.startswith("_")} - {"token_version_lag_sum",
                                                                          "episode_duration_seconds_sum"}
    episode_only = everything - set(compute(**token_fields))
    assert episode_only and {BY_NAME[n].level for n in episode_only} == {"episode"}
    episode_level = {s.name for s in CATALOGUE if s.level == "episode"}
    assert episode_level - everything == {"generation", "generation_policy_version"}
    assert {n for n in everything if BY_NAME[n].level == "episode"} == episode_level & everything


def test_entropy_per_environment_is_the_mean_over_its_own_tokens():
    """env_entropy_mean against a token-by-token reference: masked and non-finite entropies left out,
    an environment with no usable token has no value."""
    gen = torch.Generator().manual_seed(4)
    entropy = torch.rand(6, 5, generator=gen, dtype=torch.float64) * 3
    entropy[1, 0] = float("nan")
    mask = torch.rand(6, 5, generator=gen) > 0.3
    mask[5] = False                                         # environment "c": no response token
    env = ["a", "b", "a", "b", "b", "c"]
    v = compute(mask=mask, entropy=entropy, env=env)
    for name in ("a", "b"):
        terms = [float(entropy[i, t]) for i in range(6) for t in range(5)
                 if env[i] == name and mask[i, t] and math.isfinite(float(entropy[i, t]))]
        assert v["env_entropy_mean"][(name,)] == pytest.approx(sum(terms) / len(terms), rel=1e-6)
    assert v["env_entropy_mean"].get(("c",)) is None
    alone = compute(mask=mask, entropy=entropy)                # no env: one label, the whole batch's mean
    assert list(alone["env_entropy_mean"].values()) == pytest.approx([alone["entropy_mean"][()]], rel=1e-6)
