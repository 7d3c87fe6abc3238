"""rlwatch's definitions agree with verl's own rollout-correction metrics on the same tensors."""

from __future__ import annotations

import pytest
import torch

from rlwatch import SignalConfig, compute

from tests.conftest import need_module


def _tensors(seed: int, B: int = 32, T: int = 64, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    rollout = -torch.rand(B, T, generator=g) * 4
    old = rollout + scale * torch.randn(B, T, generator=g)
    return mask, rollout, old


@pytest.mark.parametrize("seed,scale,cap", [(0, 0.05, 2.0), (1, 0.3, 2.0), (2, 1.0, 3.0), (3, 0.5, 1.5)])
def test_token_level_metrics_match_verl(seed, scale, cap):
    need_module("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    mask, rollout, old = _tensors(seed, scale=scale)
    _, _, theirs = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask.float(), rollout_is="token", rollout_is_threshold=cap)
    ours = compute(SignalConfig(is_cap=cap), mask=mask, sampler_logp=rollout, trainer_logp=old)
    pairs = {
        "kl": "mismatch_kl_k1",
        "k3_kl": "mismatch_kl_k3",
        "chi2_token": "mismatch_chi2_token",
        "chi2_seq": "mismatch_chi2_sequence",
        "rollout_is_ratio_fraction_high": "is_tis_high_ratio",
        "rollout_is_ratio_fraction_low": "is_tis_low_ratio",
        "rollout_is_eff_sample_size": "is_ess_ratio",
    }
    for theirs_key, ours_key in pairs.items():
        expected = theirs[f"rollout_corr/{theirs_key}"]
        assert ours[ours_key][()] == pytest.approx(expected, rel=2e-5, abs=1e-7), theirs_key


def test_masked_fraction_matches_verl_icepop_and_rejection():
    need_module("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    mask, rollout, old = _tensors(4, scale=1.0)
    _, _, icepop = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask.float(), rollout_is="token", rollout_is_threshold="0.5_5.0")
    _, _, rejection = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask.float(), rollout_rs="token_k1", rollout_rs_threshold="0.5_5.0")
    ours = compute(SignalConfig(mis_band=(0.5, 5.0)), mask=mask, sampler_logp=rollout, trainer_logp=old)
    assert ours["is_mis_masked_ratio"][()] == pytest.approx(icepop["rollout_corr/rollout_is_oob_ratio"], rel=1e-6)
    assert ours["is_mis_masked_ratio"][()] > 0.05
    # verl's token_k1 rejection bounds k1 = log(mu/pi), the inverse ratio: its band [0.5, 5] on mu/pi is
    # rlwatch's MIS band [0.2, 2] on w = pi/mu.
    inverse = compute(SignalConfig(mis_band=(0.2, 2.0)), mask=mask, sampler_logp=rollout, trainer_logp=old)
    assert inverse["is_mis_masked_ratio"][()] == pytest.approx(
        rejection["rollout_corr/rollout_rs_masked_fraction"], rel=1e-6)


def test_sequence_level_fractions_match_verl_sequence_mode():
    need_module("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    mask, rollout, old = _tensors(5, scale=0.2, T=16)
    _, _, theirs = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask.float(), rollout_is="sequence", rollout_is_threshold=2.0)
    ours = compute(mask=mask, sampler_logp=rollout, trainer_logp=old)
    assert ours["is_seq_tis_high_ratio"][()] == pytest.approx(theirs["rollout_corr/rollout_is_ratio_fraction_high"])
    assert ours["is_seq_tis_low_ratio"][()] == pytest.approx(theirs["rollout_corr/rollout_is_ratio_fraction_low"])
    assert 0 < ours["is_seq_tis_high_ratio"][()] < 1
