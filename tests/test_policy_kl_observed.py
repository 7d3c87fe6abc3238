"""The policy KL computed by rlwatch from ``observe``'s ``updated_logp`` (the tokens' log-probs after the
update) against ``trainer_logp`` (before it): k3 over the masked tokens with a finite difference, checked
against a token-by-token reference; the trainer's logged ``ppo_kl`` is used only for a step without it."""

from __future__ import annotations

import math

import pytest
import torch

import rlwatch
from rlwatch.runs.store import StoreReader


def _reference(updated: list[list[float]], before: list[list[float]], mask: list[list[int]]) -> float:
    """mean over the masked tokens with a finite difference of exp(d) - d - 1, d = updated - before."""
    terms = []
    for row_u, row_b, row_m in zip(updated, before, mask):
        for u, b, m in zip(row_u, row_b, row_m):
            d = u - b
            if m and math.isfinite(d):
                d = max(-20.0, min(20.0, d))
                terms.append(math.exp(d) - d - 1)
    return sum(terms) / len(terms)


def _step(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    before = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 3
    updated = before + 0.3 * torch.randn(4, 7, generator=gen, dtype=torch.float64)
    updated[1, 2] = float("nan")                    # not counted
    updated[2, 6] = before[2, 6] + 50.0             # clamped to 20 nats
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[0, 5:] = False
    mask[3, 1] = False
    return dict(mask=mask, trainer_logp=before, sampler_logp=before - 0.01, updated_logp=updated)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_kl_is_k3_of_the_update_over_the_masked_tokens(seed):
    f = _step(seed)
    watch = rlwatch.Watch(run="pk", port=None, store=None, background=False, strict=True)
    values = watch.observe(1, **f)
    watch.close()
    want = _reference(f["updated_logp"].tolist(), f["trainer_logp"].tolist(), f["mask"].int().tolist())
    assert values["policy_kl"][()] == pytest.approx(want, rel=1e-9)


def test_without_updated_logp_rlwatch_computes_no_policy_kl():
    f = _step(0)
    del f["updated_logp"]
    watch = rlwatch.Watch(run="pk", port=None, store=None, background=False, strict=True)
    values = watch.observe(1, **f)
    watch.close()
    assert "policy_kl" not in values


@pytest.mark.parametrize("order", ["observe_first", "scalars_first"])
def test_rlwatchs_policy_kl_wins_and_the_trainers_fills_a_step_without_it(tmp_path, order):
    path = str(tmp_path / "run.db")
    watch = rlwatch.Watch(run="pk", port=None, store=path, background=False, strict=True)
    computed = {}
    for step in range(1, 5):
        f = _step(step)
        if step == 4:
            del f["updated_logp"]                   # this step: the trainer's value only
        else:
            computed[step] = _reference(f["updated_logp"].tolist(), f["trainer_logp"].tolist(),
                                        f["mask"].int().tolist())
        calls = [lambda: watch.observe(step, **f), lambda: watch.log_scalars(step, {"actor/ppo_kl": -0.5})]
        for call in calls if order == "observe_first" else calls[::-1]:
            call()
    watch.close()
    with StoreReader(path) as reader:
        rows = {row.step: row for row in reader.steps("pk")}
    for step, want in computed.items():
        assert rows[step].get("policy_kl") == pytest.approx(want, rel=1e-9), step
    assert rows[4].get("policy_kl") == -0.5
