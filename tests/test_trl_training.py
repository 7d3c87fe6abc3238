"""TRL integration end to end: a real GRPOTrainer on CPU with a tiny offline model.

The test side taps TRL's own tensors with its own wrappers on the trainer (installed before
rlwatch's, so rlwatch wraps them) and rebuilds, independently of the integration, each optimizer
step's token-level record (the micro-batches TRL trained on) and each generation batch's
episode-level record (rewards recomputed from the decoded completions, environments from the
prompt text, truncation and lengths from the unpadded ids, groups from the batch order). What
rlwatch exported (the run store, and /metrics) must equal ``rlwatch.compute`` on those records,
and agree with TRL's own logged numbers (``frac_reward_zero_std``, ``completions/clipped_ratio``,
``rewards/<fn>/mean``, ``completions/mean_length``, ``sampling/*``) on the same episodes and tokens.
A configuration matrix runs each of TRL's batching knobs through a real short training.
"""

from __future__ import annotations

import logging

import pytest
import torch

from rlwatch.signals import SignalConfig
from rlwatch.runs.store import StoreReader

from .conftest import need_module

need_module("trl")

from rlwatch.integrations import trl as rltrl  # noqa: E402

from ._trl_tiny import REWARD_FUNCS, make_trainer  # noqa: E402
from ._trl_helpers import (Tap, assert_agrees_with_trl, assert_row_matches, assert_scrape_matches,  # noqa: E402
                           expected_rows, run_and_check, sample, scrape, strip_timing, trl_logs)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


#: The configuration matrix: every value of each knob, and the interactions that decide where groups
#: and lags fall (generation batches split over steps, reused, or several per step).
MATRIX = {
    # name: (config, reward functions, rollout)
    "one-batch-per-step": (dict(per_device_train_batch_size=8, num_generations=4, max_steps=2), None, False),
    "issue-reuse-and-split": (dict(per_device_train_batch_size=4, num_generations=4, num_iterations=2,
                                   steps_per_generation=2, max_steps=3), None, False),
    "spg4-G2-none-rewards": (dict(per_device_train_batch_size=2, num_generations=2, steps_per_generation=4,
                                  max_steps=3, loss_type="grpo"), "has_w1", False),
    "ga2-two-batches-per-step-G8": (dict(per_device_train_batch_size=8, num_generations=8,
                                         gradient_accumulation_steps=2, steps_per_generation=1, max_steps=2,
                                         loss_type="cispo"), None, False),
    "ga2-spg2-reuse-G2": (dict(per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=2,
                               steps_per_generation=2, num_iterations=2, max_steps=3, loss_type="sapo"), None, False),
    "rollout-spg4-G8": (dict(per_device_train_batch_size=4, num_generations=8, steps_per_generation=4, max_steps=3,
                             loss_type="bnpo"), "length", True),
    "rollout-ga2-ni2": (dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
                             num_iterations=2, max_steps=2, loss_type="dr_grpo"), None, True),
    # TRL 1.16's sequence-level losses: LUSPO with sequence-level importance weights (GSPO's), and VESPO,
    # whose Gamma weighting takes TRL's importance-sampling ratios (token modes only) instead of scaling
    # the loss by them. They change TRL's clip logs (VESPO logs vespo/phi_seq_mean), not rlwatch's inputs.
    "luspo-sequence-level-ni2": (dict(per_device_train_batch_size=4, num_generations=4, num_iterations=2, max_steps=2,
                                      loss_type="luspo", importance_sampling_level="sequence"), None, False),
    "rollout-vespo-token-truncate": (dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
                                          max_steps=2, loss_type="vespo",
                                          vllm_importance_sampling_mode="token_truncate"), None, True),
}
FUNCS = {None: None, "has_w1": [REWARD_FUNCS[1]], "length": [REWARD_FUNCS[0]]}


@pytest.mark.parametrize("cell", list(MATRIX))
def test_configuration_matrix(model_path, tmp_path, cell):
    config, funcs, rollout = MATRIX[cell]
    trainer, tap, rows, _ = run_and_check(model_path, tmp_path, f"trl-{cell}", funcs=FUNCS[funcs], rollout=rollout,
                                          **config)
    args = trainer.args
    # Generation batches: one per steps_per_generation * num_iterations micro-batches.
    micro_batches = trainer.state.global_step * args.gradient_accumulation_steps
    assert len(tap.gens) == -(-micro_batches // (args.steps_per_generation * trainer.num_iterations))
    # The lag of a step's last micro-batch counts the updates since its batch was generated.
    for s, row in rows.items():
        assert row.get("generation") == max(serial for serial, g in enumerate(tap.gens, 1) if g["step"] <= s)
    # The loss variants are really in effect: TRL logs what each of them computes.
    logged = set().union(*trl_logs(trainer).values())
    loss_key = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean", "sapo": None}.get(
        args.loss_type, "clip_ratio/region_mean")
    assert loss_key is None or loss_key in logged, (args.loss_type, sorted(logged))
    assert not ({"cispo_clip_ratio", "vespo/phi_seq_mean", "clip_ratio/region_mean"} - {loss_key}) & logged
    if funcs == "has_w1":        # None for every code prompt: unscorable episodes, counted as failures
        failed = sum(v for (e, kind), v in rows[1].values["episodes_failed_total"].items() if kind == "unscorable")
        assert failed > 0 and rows[1].get("reward_mean") is not None


def test_grpo_run_exports_what_trl_computed(model_path, tmp_path, caplog):
    """num_iterations=2 and two micro-batches per step, over HTTP: lag 0 then 1, whole groups once per
    generation batch, env column, checkpoints and logged scalars; and the run's numbers equal a run
    without rlwatch."""
    caplog.set_level(logging.WARNING, logger="rlwatch")
    config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_iterations=2, max_steps=4,
                  save_strategy="steps", save_steps=2)
    trainer = make_trainer(model_path, tmp_path / "out", **config)
    tap = Tap(trainer)
    store = str(tmp_path / "run.db")
    watch = rltrl.watch(trainer, run="trl-e2e", port=0, store=store)
    assert watch.signal_config.group_size == 4
    assert rltrl.trainer_device(trainer) == "cpu" and watch._worker is None     # CPU: computed inline
    trainer.train()
    watch.flush()
    samples = scrape(watch.url)

    steps = tap.steps()
    assert sorted(steps) == [1, 2, 3, 4] and all(len(m) == 2 for m in steps.values())
    expected = expected_rows(tap, trainer, SignalConfig(group_size=4))
    with StoreReader(store) as reader:
        rows = {row.step: row for row in reader.steps("trl-e2e")}
        assert sorted(rows) == [1, 2, 3, 4]
        for s in rows:
            assert_row_matches(rows[s], expected[s])
        meta = reader.meta("trl-e2e")
        checkpoints = reader.checkpoints("trl-e2e")
        scalars = reader.scalars("trl-e2e")
    assert_agrees_with_trl(rows, scalars, tap, trainer)

    # Lag: the second pass over each generation batch is one update old.
    assert [expected[s]["version_lag_max"][()] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]
    assert rows[2].get("token_version_lag", ("1",)) == rows[2].get("tokens")
    # Groups once per generation batch (2 prompts x 4 completions), scored at steps 1 and 3 and shown,
    # with their generation number, until the next batch.
    assert [rows[s].get("generation") for s in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert [rows[s].get("generation_policy_version") for s in (1, 2, 3, 4)] == [0, 0, 2, 2]
    assert [rows[s].get("groups") for s in (1, 2, 3, 4)] == [2, 2, 2, 2]
    assert [rows[s].get("groups_total") for s in (1, 2, 3, 4)] == [2, None, 2, None]
    assert {labels for labels in rows[1].values["env_episodes"]} <= {("math",), ("code",)}
    assert sum(rows[1].values["env_episodes"].values()) == 8

    # The endpoint: last step's gauges, counters summed over the steps, lag histogram over all tokens.
    totals = {"tokens_total": sum(e["tokens"][()] for e in expected.values()),
              "sequences_total": 32.0, "steps_total": 4.0, "groups_total": 4.0}
    assert_scrape_matches(samples, "trl-e2e", expected[4], totals)
    assert sample(samples, "rlwatch_generation", run="trl-e2e") == 2
    lag_tokens = sum(e["tokens"][()] for s, e in expected.items() if s % 2 == 0)
    lag_zero = sample(samples, "rlwatch_token_version_lag_bucket", run="trl-e2e", le="0.0")
    assert lag_zero == totals["tokens_total"] - lag_tokens
    assert sample(samples, "rlwatch_token_version_lag_sum", run="trl-e2e") == lag_tokens
    assert sample(samples, "rlwatch_sampler_temperature", run="trl-e2e") == 1.0
    assert sample(samples, "rlwatch_signal_unavailable_total", run="trl-e2e", signal="mismatch",
                  reason="no_sampler_logprobs") == 4

    # Checkpoints, TRL's logged scalars, run metadata, no rlwatch errors.
    out = tmp_path / "out"
    logs = trl_logs(trainer)
    assert checkpoints == [(2, str(out / "checkpoint-2")), (4, str(out / "checkpoint-4"))]
    assert all((out / f"checkpoint-{s}" / "trainer_state.json").exists() for s in (2, 4))
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["loss"]] == pytest.approx([logs[s]["loss"] for s in (1, 2, 3, 4)])
    assert [s for s, _ in scalars["rlwatch/rewards/reward_length/mean"]] == [1, 3]
    assert "rlwatch/rewards/reward_has_w1/math/mean" in scalars
    assert "rlwatch/rewards/reward_has_w1/code/mean" not in scalars      # None for every code prompt
    assert meta["framework"] == "trl" and meta["framework_version"].startswith("1.1")
    assert meta["trl"]["num_iterations"] == 2 and meta["trl"]["num_generations"] == 4
    # The headline signals in TRL's own log (hence W&B/TensorBoard), this step's values (computed inline).
    for s in (1, 2, 3, 4):
        assert logs[s]["rlwatch/version_lag_max"] == rows[s].get("version_lag_max")
        assert logs[s]["rlwatch/version_lag_over_bound_frac"] == rows[s].get("version_lag_over_bound_ratio")
        all_fail = rows[s].get("zero_variance_groups_ratio", ("all_fail",))
        assert logs[s]["rlwatch/zero_variance_all_fail_frac"] == all_fail
        assert logs[s]["rlwatch/alerts_firing"] == 0 and "rlwatch/kl_k3" not in logs[s]   # no sampler log-probs
    assert watch.errors.total() == 0, watch.errors.snapshot()
    rltrl.unwatch(trainer)
    assert "log" not in vars(trainer)                              # unwatch restores trainer.log
    assert rltrl.GenerationSignals not in {type(x) for x in watch.listeners}

    # Never change the trainer's numbers: the same run without rlwatch gives identical logs and weights.
    baseline = make_trainer(model_path, tmp_path / "base", **config)
    baseline.train()
    assert strip_timing(baseline.state.log_history) == strip_timing(trainer.state.log_history)
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), baseline.model.named_parameters()):
        assert torch.equal(a, b), name


#: Sampler log-probs through a rollout_func: TRL's importance-sampling correction off and on in its modes.
IS_CELLS = {
    "correction-off": dict(vllm_importance_sampling_correction=False),
    "token-truncate-nothing-clipped": dict(vllm_importance_sampling_mode="token_truncate",
                                           vllm_importance_sampling_clip_max=1e6),
    "token-truncate-C2": dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0),
    "token-mask-C3": dict(vllm_importance_sampling_mode="token_mask"),
    "sequence-mask-C3": dict(),                           # TRL's default mode
    # VESPO reads TRL's token-masked ratios inside its Gamma weights (TRL logs sampling/* the same way)
    "vespo-token-mask-C3": dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask"),
}


@pytest.mark.parametrize("cell", list(IS_CELLS))
def test_importance_sampling_agrees_with_trl(model_path, tmp_path, cell):
    """Each step trains exactly one generation batch (gradient accumulation = steps_per_generation), so
    rlwatch's per-step token signals and TRL's per-batch sampling/* logs cover the same tokens."""
    settings = IS_CELLS[cell]
    clip = settings.get("vllm_importance_sampling_clip_max", 3.0)
    cap = min(clip, 1e3)
    trainer, tap, rows, _ = run_and_check(
        model_path, tmp_path, f"trl-is-{cell}", rollout=True, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, steps_per_generation=2, max_steps=2,
        watch_options=dict(is_cap=cap, mis_band=(1e-30, cap)), **settings)
    logs = trl_logs(trainer)
    assert "log" not in vars(trainer)                              # unwatch restores trainer.log
    # The headline signals in TRL's log: this step's values, or the one before's if computed in the background.
    for key, name in (("kl_k3", "mismatch_kl_k3"), ("abs_log_ratio_p99", "mismatch_abs_log_ratio_p99"),
                      ("is_ess", "is_ess_ratio"), ("is_tis_truncated_frac", "is_tis_high_ratio")):
        mirrored = [s for s in rows if f"rlwatch/{key}" in logs[s]]
        assert mirrored, key
        assert all(logs[s][f"rlwatch/{key}"] in (rows[s].get(name), (rows.get(s - 1) or rows[s]).get(name))
                   for s in mirrored), key
    acted = 0.0                                  # tokens or sequences TRL's correction clamped or masked
    for s, micro in tap.steps().items():
        row, log = rows[s], logs[s]
        mask = torch.cat([m["inputs"]["completion_mask"].reshape(-1) for m in micro]).bool()
        if cell == "correction-off":
            # TRL logs no sampling/* and keeps no pi_old (one use per step): rlwatch compares mu with the
            # policy's log-probs of the same forward, which TRL itself uses as pi_old.
            assert not any(k.startswith("sampling/") for k in log)
            assert all(m["inputs"].get("old_per_token_logps") is None for m in micro)
            assert row.get("mismatch_abs_log_ratio_mean") > 0.5
            continue
        # Mean and max |pi_old - mu| over the batch's tokens: TRL's sampling_logp_difference.
        assert row.get("mismatch_abs_log_ratio_mean") == pytest.approx(log["sampling/sampling_logp_difference/mean"],
                                                                       rel=1e-5)
        assert row.get("mismatch_abs_log_ratio_max") == pytest.approx(log["sampling/sampling_logp_difference/max"],
                                                                      rel=1e-5)
        applied = None if "sequence" in cell else torch.cat([m["inputs"]["importance_sampling_ratio"] for m in micro])
        low, mean, high = (log[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max"))
        if cell == "token-truncate-nothing-clipped":          # the same ratios: equal
            assert row.get("is_ratio_min") == pytest.approx(low, rel=1e-5)
            assert row.get("is_ratio_mean") == pytest.approx(mean, rel=1e-5)
            assert row.get("is_ratio_max") == pytest.approx(high, rel=1e-5)
        elif cell == "token-truncate-C2":                     # TRL's ratios are min(w, C): min and max commute
            assert high == pytest.approx(min(row.get("is_ratio_max"), clip), rel=1e-5)
            assert low == pytest.approx(min(row.get("is_ratio_min"), clip), rel=1e-5)
            assert row.get("is_ratio_mean") > mean
            # the tokens TRL clamped are exactly those rlwatch counts over the cap
            clamped = float(((applied >= clip) & mask.reshape(applied.shape)).sum())
            assert row.get("is_tis_high_ratio") == pytest.approx(clamped / float(mask.sum()))
            acted += clamped
        elif cell.endswith("token-mask-C3"):                         # TRL zeroes w > C: its min is 0 when any is
            zeroed = float(((applied == 0) & mask.reshape(applied.shape)).sum())
            assert row.get("is_mis_masked_ratio") == pytest.approx(zeroed / float(mask.sum()))
            assert (low == 0) == (zeroed > 0) and row.get("is_ratio_max") > clip >= high
            acted += zeroed
        else:                                                  # one ratio per sequence, exp(sum of r): zeroed > C
            seq = torch.cat([m["inputs"]["importance_sampling_ratio"].reshape(-1) for m in micro])
            assert row.get("is_seq_mis_masked_ratio") == pytest.approx(float((seq == 0).sum()) / seq.numel())
            assert row.get("is_ratio_max") >= high
            acted += float((seq == 0).sum())
    assert acted > 0 or cell in ("correction-off", "token-truncate-nothing-clipped")
