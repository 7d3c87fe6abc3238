"""Fast checks of the demo scenario engine (a few small steps each)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from rlwatch.demo.scenario import (
    EOS, ENV_NAMES, PAD, SCENARIOS, ScenarioConfig, StepInfo, collapse_step, grade, run_scenario,
)

SMALL = dict(steps=3, prompts_per_step=4, group_size=4, pretrain_steps=20, heldout_prompts=16, threads=1)
FIELD_KEYS = {"mask", "sampler_logp", "trainer_logp", "token_version", "trainer_version", "rewards", "group_ids",
              "truncated", "env", "entropy", "temperature", "top_p", "durations", "dropped_reasons", "phases"}


def small(name: str = "healthy", **overrides) -> ScenarioConfig:
    return replace(SCENARIOS[name], **{**SMALL, **overrides})


def collect(config: ScenarioConfig, **kwargs) -> tuple[list[StepInfo], object]:
    infos: list[StepInfo] = []
    result = run_scenario(config, on_step=infos.append, **kwargs)
    return infos, result


def masked_mismatch(fields: dict) -> tuple[float, float]:
    """(mean |trainer - sampler|, mean signed trainer - sampler) over masked tokens."""
    m = fields["mask"]
    r = (fields["trainer_logp"] - fields["sampler_logp"])[m]
    return r.abs().mean().item(), r.mean().item()


def test_fields_follow_the_contract():
    infos, result = collect(small())
    assert len(infos) == 3 and len(result.history) == 3
    b = SMALL["prompts_per_step"] * SMALL["group_size"]
    for info in infos:
        f = info.fields
        assert set(f) == FIELD_KEYS
        t = f["mask"].shape[1]
        expected = {"mask": torch.bool, "sampler_logp": torch.float32, "trainer_logp": torch.float32,
                    "token_version": torch.int64, "entropy": torch.float32}
        for key, dtype in expected.items():
            assert f[key].shape == (b, t) and f[key].dtype == dtype and f[key].device.type == "cpu", key
            assert torch.isfinite(f[key].float()).all(), key
        # The demo's own timings: each episode ends at a decode step, the longer responses later.
        assert f["durations"].shape == (b,) and (f["durations"] > 0).all() and f["dropped_reasons"] == []
        longest, shortest = f["mask"].sum(1).argmax(), f["mask"].sum(1).argmin()
        assert f["durations"][longest] >= f["durations"][shortest]
        assert set(f["phases"]) == {"generation", "old_logp", "training", "sync"}
        assert all(s > 0 for s in f["phases"].values())
        assert f["rewards"].shape == (b,) and f["rewards"].dtype == torch.float32
        assert f["group_ids"].shape == (b,) and f["group_ids"].dtype == torch.int64
        assert f["truncated"].shape == (b,) and f["truncated"].dtype == torch.bool
        assert isinstance(f["env"], list) and len(f["env"]) == b and set(f["env"]) <= set(ENV_NAMES)
        assert f["trainer_version"] == info.step and isinstance(f["trainer_version"], int)
        assert f["temperature"] == 1.0 and f["top_p"] == 1.0
        # every group has group_size members; every response has at least one trained token
        assert torch.bincount(f["group_ids"]).max().item() == SMALL["group_size"]
        assert f["mask"].any(1).all()
        assert len(info.episodes) == b
        ep = info.episodes[0]
        assert set(ep) == {"env", "prompt", "response", "reward", "true_pass", "truncated"}
        assert len(ep["response"]) == int(f["mask"][0].sum())
        assert {"train_reward", "heldout_true_reward", "entropy", "loss"} <= set(info.metrics)
    assert [s for s, _ in result.heldout] == [0, 1, 2]


def test_same_seed_same_run():
    a, ra = collect(small(steps=2))
    b, rb = collect(small(steps=2))
    assert ra.history == rb.history and ra.heldout == rb.heldout
    for x, y in zip(a, b):
        for key in ("mask", "sampler_logp", "trainer_logp", "token_version", "rewards"):
            assert torch.equal(x.fields[key], y.fields[key]), key
    c, _ = collect(small(steps=2, seed=1))
    assert not torch.equal(a[0].fields["sampler_logp"], c[0].fields["sampler_logp"])


def test_lag0_matches_and_lag_adds_mismatch():
    infos, _ = collect(small(steps=4))
    for info in infos:
        assert masked_mismatch(info.fields)[0] < 1e-5
    # partial credit keeps the tiny warm-started policy's groups from being all-zero (no update)
    infos, _ = collect(small("collapse", steps=4, partial_credit=True))
    versions = [info.fields["token_version"][info.fields["mask"]].unique().tolist() for info in infos]
    assert versions == [[0]] * 4          # lag 8: the first steps all sample with version 0
    assert masked_mismatch(infos[0].fields)[0] < 1e-5
    assert all(masked_mismatch(info.fields)[0] > 1e-3 for info in infos[1:])


def test_temperature_fault_shows_at_step_zero():
    infos, _ = collect(small("temperature_fault", steps=1))
    f = infos[0].fields
    assert f["temperature"] == pytest.approx(0.6)
    abs_mm, signed = masked_mismatch(f)
    assert abs_mm > 0.05 and abs(signed) > 0.05


def test_top_p_fault_offsets_every_token_by_the_kept_mass():
    infos, _ = collect(small("top_p_fault", steps=1))
    f = infos[0].fields
    assert f["top_p"] == pytest.approx(0.9)
    r = (f["trainer_logp"] - f["sampler_logp"])[f["mask"]]
    assert torch.isfinite(r).all()
    assert (r <= 1e-5).all()                # log(kept mass) <= 0 for every sampled token
    assert (r < -1e-3).float().mean() > 0.5  # and strictly negative for most of them


def test_partial_rollouts_switch_version_mid_sequence():
    infos, _ = collect(small("partial", steps=6))
    late = infos[-1].fields
    spans = []
    for row_versions, row_mask in zip(late["token_version"], late["mask"]):
        v = row_versions[row_mask]
        spans.append(len(v.unique()))
        assert (v[1:] >= v[:-1]).all()      # older version first, newer after
    assert max(spans) == 2 and min(spans) == 1
    assert late["token_version"][late["mask"]].max().item() == late["trainer_version"] - 2


def test_checkpoints_are_safetensors(tmp_path):
    from safetensors.torch import load_file

    seen: list[tuple[int, str]] = []
    run_scenario(small(steps=4), checkpoint_dir=str(tmp_path), checkpoint_every=2,
                 on_checkpoint=lambda step, path: seen.append((step, path)))
    assert [s for s, _ in seen] == [1, 3]
    for step, path in seen:
        assert path == os.path.join(str(tmp_path), f"checkpoint-{step}")
        tensors = load_file(os.path.join(path, "model.safetensors"))
        assert "head.weight" in tensors and all(torch.isfinite(t).all() for t in tensors.values())
        meta = json.load(open(os.path.join(path, "config.json")))
        assert meta["step"] == step and meta["trainer_version"] == step + 1


def test_should_stop_ends_after_the_current_step():
    calls = []
    result = run_scenario(small(steps=10), should_stop=lambda: calls.append(1) or len(calls) >= 2)
    assert len(result.history) == 2


def test_hack_grader_passes_prefixes_only_in_reverse():
    responses = torch.tensor([[EOS, PAD, PAD], [EOS, PAD, PAD], [1, EOS, PAD], [2, 1, EOS]])
    truncated = torch.zeros(4, dtype=torch.bool)
    targets = torch.tensor([[2, 1], [2, 1], [2, 1], [2, 1]])
    target_len = torch.tensor([2, 2, 2, 2])
    env = torch.tensor([ENV_NAMES.index("copy"), ENV_NAMES.index("reverse"), ENV_NAMES.index("reverse"),
                        ENV_NAMES.index("reverse")])
    reward, true_pass = grade(responses, truncated, targets, target_len, env, hack=True, partial_credit=False)
    assert reward.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert true_pass.tolist() == [False, False, False, True]
    reward, _ = grade(responses, truncated, targets, target_len, env, hack=False, partial_credit=False)
    assert reward.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_collapse_step_on_hand_made_series():
    assert collapse_step([]) is None
    assert collapse_step([(0, 0.0), (1, 0.0)]) is None
    assert collapse_step([(0, 0.2), (1, 0.5), (2, 0.6), (3, 0.7)]) is None
    assert collapse_step([(0, 0.2), (1, 0.6), (2, 0.2), (3, 0.1)]) == 2
    # a dip that recovers does not count; the last dip does
    assert collapse_step([(0, 0.6), (1, 0.2), (2, 0.5), (3, 0.25), (4, 0.0)]) == 3
    # exactly half the peak is not below half (0.5 * 0.8 == 0.4 exactly in binary floating point:
    # halving is exact, so this is the boundary itself)
    assert collapse_step([(0, 0.8), (5, 0.4)]) is None
    assert collapse_step([(0, 0.8), (5, 0.39), (10, 0.41)]) is None


def test_second_family_transformer_on_sort_and_shift():
    """The matrix's second policy family and task set: a causal transformer trained on sort/shift,
    whose targets are the digits sorted and each digit plus one, with the same field contract."""
    from rlwatch.demo.scenario import TransformerPolicy, make_prompts

    config = small(policy="transformer", tasks="sort-shift")
    infos, result = collect(config)
    assert len(infos) == 3 and set(infos[0].fields) == FIELD_KEYS
    assert set(infos[0].fields["env"]) == {"sort", "shift"}
    assert {e["env"] for e in infos[0].episodes} == {"sort", "shift"}
    lag0 = masked_mismatch(infos[0].fields)
    assert lag0[0] < 1e-4                        # on-policy: sampler and trainer agree
    task = make_prompts(8, config, torch.Generator().manual_seed(0))
    for prompt, target, length, env in zip(task["prompts"], task["targets"], task["target_len"], task["env"]):
        digits = [int(x) for x in prompt[-1 - int(length):-1]]
        expected = sorted(digits) if env == 0 else [(d + 1) % 10 for d in digits]
        assert target[:int(length)].tolist() == expected
    from rlwatch.demo.scenario import make_policy
    assert isinstance(make_policy(config), TransformerPolicy)


def test_infrastructure_failures_are_reported_from_their_step():
    infos, _ = collect(small(failure_rate=1.0, failure_from=1))
    assert "failed" not in infos[0].fields
    failed = infos[1].fields["failed"]
    assert failed == ["timeout"] * len(failed) and float(infos[1].fields["rewards"].sum()) == 0.0
