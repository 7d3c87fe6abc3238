"""TRL integration end to end: a real GRPOTrainer on CPU with a tiny offline model.

The test side taps TRL's own tensors with its own wrappers on the trainer (installed before
rlwatch's, so rlwatch wraps them), rebuilds each optimizer step's record from them independently
of the integration (rewards recomputed from the decoded completions, environments from the prompt
text, truncation from the unpadded ids, versions from the step at which each batch was generated),
and checks that what rlwatch exported (the real /metrics endpoint over HTTP, and the run store)
equals ``rlwatch.compute`` on that record. TRL's own logged numbers are cross-checked too.
"""

from __future__ import annotations

import logging
import math
import os
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import rlwatch
from rlwatch.metrics import BY_NAME
from rlwatch.signals import SignalConfig
from rlwatch.store import StoreReader

from .conftest import need_module

need_module("trl")

from rlwatch.integrations import trl as rltrl  # noqa: E402

from ._trl_tiny import EOS, PAD, REWARD_FUNCS, build_tiny_model, make_trainer, prompt_env  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


# --- the test's own tap on TRL ------------------------------------------------------------------------

class Tap:
    """Records, per ``_compute_loss`` call, the inputs TRL trained on, the policy's per-token log-probs
    and entropies, the global step, and which generation batch (and which pass over it) they came from."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.micro: list[dict] = []
        self._gen_step: int | None = None
        self._gen_serial = -1
        self._consumed = 0
        self._in_loss = False
        self._policy = None
        generate, loss, logps = (trainer._generate_and_score_completions, trainer._compute_loss,
                                 trainer._get_per_token_logps_and_entropies)

        def tap_generate(inputs):
            out = generate(inputs)
            if trainer.model.training:
                self._gen_step, self._gen_serial, self._consumed = trainer.state.global_step, self._gen_serial + 1, 0
            return out

        def tap_loss(model, inputs):
            self._in_loss, self._policy = True, None
            try:
                out = loss(model, inputs)
            finally:
                self._in_loss = False
            if trainer.model.training:
                self.micro.append(dict(inputs=dict(inputs), logps=self._policy[0].detach(),
                                       entropy=self._policy[1].detach(), global_step=trainer.state.global_step,
                                       gen_step=self._gen_step, gen=self._gen_serial,
                                       iteration=self._consumed // trainer.args.steps_per_generation))
                self._consumed += 1
            return out

        def tap_logps(*args, **kwargs):
            out = logps(*args, **kwargs)
            if self._in_loss and self._policy is None:
                self._policy = out
            return out

        trainer._generate_and_score_completions = tap_generate
        trainer._compute_loss = tap_loss
        trainer._get_per_token_logps_and_entropies = tap_logps

    def steps(self) -> dict[int, list[dict]]:
        """Micro-batches by optimizer step (the step TRL logs: global_step after the update)."""
        out: dict[int, list[dict]] = defaultdict(list)
        for m in self.micro:
            out[m["global_step"] + 1].append(m)
        return dict(out)


def rewards_of(texts: list[str], envs: list[str]) -> torch.Tensor:
    """The weighted reward TRL computes (weights 1; None -> NaN; nansum; all-None -> NaN)."""
    per_func = torch.tensor([[math.nan if r is None else r for r in f(completions=texts, environment=envs)]
                             for f in REWARD_FUNCS], dtype=torch.float64).T
    total = per_func.nansum(1)
    total[torch.isnan(per_func).all(1)] = math.nan
    return total


def expected_fields(micro: list[dict], trainer, groups: bool) -> dict:
    """One step's observe fields rebuilt from the tap, independently of the integration."""
    tokenizer, envs_of = trainer.processing_class, prompt_env()
    width = max(m["inputs"]["completion_mask"].shape[1] for m in micro)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    masks, trainer_lp, sampler_lp, entropy, versions = [], [], [], [], []
    rewards, truncated, env, group_ids = [], [], [], []
    for m in micro:
        inp = m["inputs"]
        mask = inp["completion_mask"]
        old = inp.get("old_per_token_logps")
        masks.append(pad(mask))
        trainer_lp.append(pad(old if old is not None else m["logps"]))      # TRL's own pi_old
        if inp.get("sampling_per_token_logps") is not None:
            sampler_lp.append(pad(inp["sampling_per_token_logps"]))
        entropy.append(pad(m["entropy"]))
        versions += [m["gen_step"]] * mask.shape[0]
        texts, row_envs = [], []
        for b in range(mask.shape[0]):
            ids = inp["completion_ids"][b, : int(mask[b].sum())].tolist()
            prompt = tokenizer.decode(inp["prompt_ids"][b][inp["prompt_mask"][b].bool()], skip_special_tokens=True)
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
            row_envs.append(envs_of[prompt])
            truncated.append(ids[-1] not in (EOS, PAD))
            group_ids.append(f"{m['gen']}/{m['iteration']}/{prompt}")
        rewards.append(rewards_of(texts, row_envs))
        env += row_envs
    fields = dict(mask=torch.cat(masks), trainer_logp=torch.cat(trainer_lp), entropy=torch.cat(entropy),
                  seq_version=torch.tensor(versions), trainer_version=micro[-1]["global_step"],
                  rewards=torch.cat(rewards), truncated=torch.tensor(truncated), env=env,
                  failed=[None if not math.isnan(r) else "unscorable" for r in torch.cat(rewards).tolist()],
                  temperature=trainer.args.temperature, top_p=trainer.args.top_p, top_k=trainer.args.top_k)
    if sampler_lp:
        fields["sampler_logp"] = torch.cat(sampler_lp)
    if groups:
        fields["group_ids"] = group_ids
    return fields


# --- scraping and comparing ---------------------------------------------------------------------------

def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def assert_row_matches(row, expected: dict) -> None:
    """Every value rlwatch.compute gives equals the stored one."""
    checked = 0
    for name, family in expected.items():
        if name.startswith("_"):
            continue
        for labels, value in family.items():
            got = row.get(name, labels)
            if value is None or not math.isfinite(value):
                assert got is None, (row.step, name, labels, got)
            else:
                assert got == pytest.approx(value, rel=1e-9, abs=1e-12), (row.step, name, labels)
            checked += 1
    assert checked > 40


def assert_scrape_matches(samples: dict, run: str, last: dict, totals: dict[str, float]) -> None:
    """The endpoint shows the last step's gauges and the counters summed over the steps."""
    checked = 0
    for name, family in last.items():
        spec = BY_NAME.get(name)
        if spec is None or spec.kind != "gauge":
            continue
        for labels, value in family.items():
            if value is None:
                continue
            key = dict(zip(("run", *spec.labels), (run, *labels)))
            assert sample(samples, spec.full_name, **key) == pytest.approx(value, rel=1e-9), name
            checked += 1
    assert checked > 30
    for name, total in totals.items():
        assert sample(samples, "rlwatch_" + name, run=run) == pytest.approx(total), name


def trl_logs(trainer) -> dict[int, dict]:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def strip_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]


# --- tests ---------------------------------------------------------------------------------------------

def test_grpo_run_exports_what_trl_computed(model_path, tmp_path, caplog):
    """num_iterations=2 and two micro-batches per step: lag 0 then 1, whole groups, env column,
    checkpoints and logged scalars; and the run's numbers equal a run without rlwatch."""
    caplog.set_level(logging.WARNING, logger="rlwatch")
    config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_iterations=2, max_steps=4,
                  save_strategy="steps", save_steps=2)
    trainer = make_trainer(model_path, tmp_path / "out", **config)
    tap = Tap(trainer)
    store = str(tmp_path / "run.db")
    watch = rltrl.watch(trainer, run="trl-e2e", port=0, store=store)
    assert watch.config.group_size == 4
    assert rltrl.trainer_device(trainer) == "cpu" and watch._worker is None     # CPU: computed inline
    trainer.train()
    watch.flush()
    samples = scrape(watch.url)

    steps = tap.steps()
    assert sorted(steps) == [1, 2, 3, 4] and all(len(m) == 2 for m in steps.values())
    expected = {s: rlwatch.compute(config=SignalConfig(group_size=4), step=s,
                                   **expected_fields(micro, trainer, groups=True))
                for s, micro in steps.items()}
    with StoreReader(store) as reader:
        rows = {row.step: row for row in reader.steps("trl-e2e")}
        assert sorted(rows) == [1, 2, 3, 4]
        for s in rows:
            assert_row_matches(rows[s], expected[s])
        meta = reader.meta("trl-e2e")
        checkpoints = reader.checkpoints("trl-e2e")
        scalars = reader.scalars("trl-e2e")

    # Lag: the second pass over each generation batch is one update old.
    assert [expected[s]["version_lag_max"][()] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]
    assert rows[2].get("token_version_lag", ("1",)) == rows[2].get("tokens")
    # Groups (2 prompts x 4 completions per pass), environments, truncation, rewards against TRL's logs.
    logs = trl_logs(trainer)
    for s in (1, 3):                                   # the steps that generated (TRL logs rewards there)
        row = rows[s]
        assert row.get("groups") == 2
        assert row.get("truncated_ratio") == pytest.approx(logs[s]["completions/clipped_ratio"])
        assert row.get("reward_mean") == pytest.approx(logs[s]["reward"], rel=1e-6)
        assert row.get("zero_gradient_episodes_ratio") == pytest.approx(logs[s]["frac_reward_zero_std"])
        assert (row.get("env_episodes", ("math",)) or 0) + (row.get("env_episodes", ("code",)) or 0) == 8
    assert {labels for labels in rows[1].values["env_episodes"]} <= {("math",), ("code",)}
    assert not any("zero-variance group signals are not computed" in r.message for r in caplog.records)

    # The endpoint: last step's gauges, counters summed over the steps, lag histogram over all tokens.
    totals = {"tokens_total": sum(e["tokens"][()] for e in expected.values()),
              "sequences_total": 32.0, "steps_total": 4.0}
    assert_scrape_matches(samples, "trl-e2e", expected[4], totals)
    lag_tokens = sum(e["tokens"][()] for s, e in expected.items() if s % 2 == 0)
    assert sample(samples, "rlwatch_token_version_lag_bucket", run="trl-e2e", le="0.0") == totals["tokens_total"] - lag_tokens
    assert sample(samples, "rlwatch_token_version_lag_sum", run="trl-e2e") == lag_tokens
    assert sample(samples, "rlwatch_sampler_temperature", run="trl-e2e") == 1.0

    # Checkpoints, TRL's logged scalars, run metadata, no rlwatch errors.
    out = tmp_path / "out"
    assert checkpoints == [(2, str(out / "checkpoint-2")), (4, str(out / "checkpoint-4"))]
    assert all((out / f"checkpoint-{s}" / "trainer_state.json").exists() for s in (2, 4))
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["loss"]] == pytest.approx([logs[s]["loss"] for s in (1, 2, 3, 4)])
    assert [s for s, _ in scalars["rlwatch/rewards/reward_length/mean"]] == [1, 2, 3, 4]
    assert "rlwatch/rewards/reward_has_w1/math/mean" in scalars
    assert "rlwatch/rewards/reward_has_w1/code/mean" not in scalars      # None for every code prompt
    assert meta["framework"] == "trl" and meta["framework_version"].startswith("1.1")
    assert meta["trl"]["num_iterations"] == 2 and meta["trl"]["num_generations"] == 4
    assert watch.errors.total() == 0, watch.errors.snapshot()
    rltrl.unwatch(trainer)

    # Never change the trainer's numbers: the same run without rlwatch gives identical logs and weights.
    baseline = make_trainer(model_path, tmp_path / "base", **config)
    baseline.train()
    assert strip_timing(baseline.state.log_history) == strip_timing(trainer.state.log_history)
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), baseline.model.named_parameters()):
        assert torch.equal(a, b), name


def test_sampler_logprobs_flow_from_rollout_func(model_path, tmp_path):
    """The vLLM code path via a rollout_func: sampler log-probs vs TRL's recomputed pi_old on the same
    tokens, two generation batches of different widths per step, TRL's IS truncation (which TRL logs
    no fraction of) equals rlwatch's."""
    trainer = make_trainer(model_path, tmp_path / "out", rollout=True, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, steps_per_generation=1, max_steps=3,
                           vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0)
    tap = Tap(trainer)
    store = str(tmp_path / "run.db")
    # background=True: the default on accelerators (on CPU the hook computes inline, as in the test above).
    watch = rltrl.watch(trainer, run="trl-rollout", port=0, store=store, is_cap=2.0, background=True)
    assert watch._worker is not None
    trainer.train()
    watch.flush()
    samples = scrape(watch.url)

    steps = tap.steps()
    assert sorted(steps) == [1, 2, 3]
    expected = {s: rlwatch.compute(config=SignalConfig(group_size=4, is_cap=2.0), step=s,
                                   **expected_fields(micro, trainer, groups=True))
                for s, micro in steps.items()}
    with StoreReader(store) as reader:
        rows = {row.step: row for row in reader.steps("trl-rollout")}
    assert sorted(rows) == [1, 2, 3]
    logs = trl_logs(trainer)
    for s, micro in steps.items():
        assert_row_matches(rows[s], expected[s])
        row = rows[s]
        assert row.get("mismatch_kl_k3") > 0.05                    # made-up sampler log-probs: large mismatch
        assert row.get("groups") == 2 and row.get("sequences") == 8
        assert row.get("version_lag_max") == 0
        # TRL's token_truncate IS ratio is clamped exactly where w = exp(pi_old - mu) > C.
        clamped = sum(float(((m["inputs"]["importance_sampling_ratio"] >= 2.0) & m["inputs"]["completion_mask"].bool())
                            .sum()) for m in micro)
        tokens = sum(float(m["inputs"]["completion_mask"].sum()) for m in micro)
        assert row.get("is_tis_high_ratio") == pytest.approx(clamped / tokens)
        # TRL logs the mean over generation batches of its per-batch mean |pi_old - mu|.
        per_batch = []
        for m in micro:
            inp = m["inputs"]
            delta = (inp["old_per_token_logps"] - inp["sampling_per_token_logps"]).abs()[inp["completion_mask"].bool()]
            per_batch.append(float(delta.mean()))
        assert logs[s]["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(per_batch) / 2, rel=1e-5)
        assert row.get("truncated_ratio") == pytest.approx(logs[s]["completions/clipped_ratio"])
    assert any(rows[s].get("is_tis_high_ratio") > 0 for s in rows)
    assert any(0 < rows[s].get("truncated_ratio") < 1 for s in rows)
    # Batches of different widths were padded into one step record.
    assert any(len({m["inputs"]["completion_mask"].shape[1] for m in micro}) > 1 for micro in steps.values())
    assert sample(samples, "rlwatch_mismatch_kl_k3", run="trl-rollout") == pytest.approx(
        expected[3]["mismatch_kl_k3"][()], rel=1e-9)
    assert ("rlwatch_sampler_info", (("logprobs_mode", "processed_logprobs"), ("run", "trl-rollout"))) not in samples
    assert watch.errors.total() == 0, watch.errors.snapshot()
    rltrl.unwatch(trainer)


def test_split_generation_batch_through_the_callback(model_path, tmp_path, caplog):
    """A user-made Watch passed as callbacks=[RLWatchCallback(watch)] attaches at train begin.
    steps_per_generation=2 > gradient_accumulation_steps=1: the second half of each generation batch
    is trained one update later (lag 1), and groups are split across steps, so the group signals
    are left out (with one warning)."""
    caplog.set_level(logging.WARNING, logger="rlwatch")
    store = str(tmp_path / "run.db")
    watch = rlwatch.Watch(run="trl-split", port=None, store=store, framework="trl")
    callback = rltrl.RLWatchCallback(watch)
    trainer = make_trainer(model_path, tmp_path / "out", callbacks=[callback], steps_per_generation=2, max_steps=2)
    trainer.train()
    watch.flush()
    with StoreReader(store) as reader:
        rows = reader.steps("trl-split")
    assert [r.step for r in rows] == [1, 2]
    assert [r.get("version_lag_max") for r in rows] == [0.0, 1.0]
    assert [r.get("sequences") for r in rows] == [8.0, 8.0]
    assert all(r.get("groups") is None and r.get("reward_mean") is not None for r in rows)
    assert sum("zero-variance group signals are not computed" in r.message for r in caplog.records) == 1
    assert callback.trainer is trainer and rltrl.watch(trainer) is watch    # attached through the stack
    rltrl.unwatch(trainer)
    assert callback in trainer.callback_handler.callbacks                   # the user's callback stays
    assert not watch._closed                                                # and so does the user's Watch
    watch.close()


def test_guard_stops_training_and_saves(model_path, tmp_path):
    """Guards stop_on_critical and save_on_critical: the critical KL spike of the made-up sampler
    log-probs (critical once it holds 2 consecutive steps, the paging policy) stops a 6-step run at
    step 2, with a checkpoint."""
    store = str(tmp_path / "run.db")
    trainer = make_trainer(model_path, tmp_path / "out", rollout=True, max_steps=6)
    watch = rltrl.watch(trainer, run="trl-guard", port=None, store=store,
                        guard=(rltrl.stop_on_critical, rltrl.save_on_critical))
    trainer.train()
    watch.flush()
    assert trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").exists()
    with StoreReader(store) as reader:
        assert [r.step for r in reader.steps("trl-guard")] == [1, 2]
        fired = [a for a in reader.alerts("trl-guard") if a["state"] == "firing" and a["severity"] == "critical"]
        assert "RLWatchKLSpike" in [a["name"] for a in fired] and all(a["step"] == 2 for a in fired)
        assert reader.checkpoints("trl-guard") == [(2, str(tmp_path / "out" / "checkpoint-2"))]
    rltrl.unwatch(trainer)


def test_idempotent_and_unwatch_restores(model_path, tmp_path, caplog):
    trainer = make_trainer(model_path, tmp_path / "out", max_steps=1)
    names = ("_calculate_rewards", "_generate_and_score_completions", "_compute_loss",
             "_get_per_token_logps_and_entropies")
    before = {name: getattr(trainer, name) for name in names}
    callbacks_before = list(trainer.callback_handler.callbacks)
    watch = rltrl.watch(trainer, run="trl-idem", port=0, store=None)
    assert all(name in vars(trainer) for name in names)
    caplog.set_level(logging.WARNING, logger="rlwatch")
    assert rltrl.watch(trainer, run="other") is watch
    assert "already watched" in caplog.text
    assert sum(isinstance(c, rltrl.RLWatchCallback) for c in trainer.callback_handler.callbacks) == 1
    rltrl.unwatch(trainer)
    assert not any(name in vars(trainer) for name in names)
    assert {name: getattr(trainer, name) for name in names} == before
    assert trainer.callback_handler.callbacks == callbacks_before
    assert watch.url is not None and watch._closed
    rltrl.unwatch(trainer)                                               # a second unwatch is a no-op


def test_unsupported_version_refuses_and_patches_nothing(model_path, tmp_path, monkeypatch, caplog):
    from rlwatch.integrations import _base

    monkeypatch.setattr(_base, "installed_version", lambda package: "1.17.0")
    trainer = make_trainer(model_path, tmp_path / "out", max_steps=1)
    callbacks_before = list(trainer.callback_handler.callbacks)
    caplog.set_level(logging.WARNING, logger="rlwatch")
    watch = rltrl.watch(trainer, run="trl-old", port=None, store=None)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "supports trl >=1.15,<1.17, found 1.17.0" in warnings[0].getMessage()
    assert not any(name.startswith("_") and callable(v) for name, v in vars(trainer).items()
                   if name in ("_calculate_rewards", "_generate_and_score_completions", "_compute_loss",
                               "_get_per_token_logps_and_entropies"))
    assert trainer.callback_handler.callbacks == callbacks_before
    assert watch.metadata["framework_version"] == "1.17.0"
    watch.close()


def test_hook_errors_never_reach_the_trainer(model_path, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("rlwatch bug")

    # A failure while assembling the step (on rlwatch's thread) and one while capturing (on the
    # training thread): both counted, the training unharmed.
    for patched, kind in (("step_fields", "trl_observe"), ("_on_loss", "trl_loss")):
        with monkeypatch.context() as patch:
            patch.setattr(rltrl.GRPOInstrumentor, patched, boom)
            trainer = make_trainer(model_path, tmp_path / patched, max_steps=2)
            watch = rltrl.watch(trainer, run="trl-errors", port=None, store=None, background=True)
            trainer.train()
            assert trainer.state.global_step == 2
            assert watch.errors.snapshot()[("integration", kind)] == 2
            rltrl.unwatch(trainer)

    # strict=True is for tests: there the error does reach the caller.
    monkeypatch.setattr(rltrl.GRPOInstrumentor, "_on_generation", boom)
    trainer = make_trainer(model_path, tmp_path / "strict", max_steps=1)
    rltrl.watch(trainer, run="trl-strict", port=None, store=None, strict=True)
    with pytest.raises(RuntimeError, match="rlwatch bug"):
        trainer.train()
    rltrl.unwatch(trainer)


def test_pure_helpers():
    from types import SimpleNamespace

    # Truncated = the unpadded completion does not end on EOS/pad (never judged by the padded width).
    flags = rltrl.truncation_flags([[5, 6, EOS], [5, 6, 7, 8], [5, PAD], []], {EOS, PAD})
    assert flags.tolist() == [False, True, False, False]
    assert rltrl.env_labels([{"prompt": "a", "data_source": "gsm8k"}]) == ["gsm8k"]
    assert rltrl.env_labels([{"prompt": "a", "environment": 3, "env": "x"}]) == ["3"]
    assert rltrl.env_labels([{"prompt": "a"}]) is None

    def trainer(per_device, ga, spg, G=4):
        return SimpleNamespace(num_generations=G, args=SimpleNamespace(
            per_device_train_batch_size=per_device, gradient_accumulation_steps=ga, steps_per_generation=spg))

    assert rltrl.whole_groups(trainer(8, 1, 1)) and rltrl.whole_groups(trainer(4, 2, 2))
    assert rltrl.whole_groups(trainer(4, 2, 1))           # two generation batches per step
    assert not rltrl.whole_groups(trainer(8, 1, 2))       # half a (shuffled) batch per step
    assert not rltrl.whole_groups(trainer(2, 1, 1))       # groups span processes
    padded = rltrl._cat_tokens([torch.ones(2, 3), torch.ones(1, 5)], 5)
    assert padded.shape == (3, 5) and padded[:2, 3:].eq(0).all() and padded[2].eq(1).all()


def test_postmortem_and_probe_on_a_trl_output_directory(model_path, tmp_path):
    """`rlwatch postmortem OUT --probe` on what a real TRL run left: the store the one-line hook
    wrote next to the checkpoints, TRL's log history, the checkpoint directories, and the fixed
    rollouts the hook kept; every checkpoint is scored on them (safetensors, nothing unpickled)."""
    import json
    import subprocess
    import sys

    from rlwatch.postmortem.probe import ROLLOUTS_FILE, load_rollouts

    out = tmp_path / "out"
    trainer = make_trainer(model_path, out, max_steps=3, save_strategy="steps", save_steps=1, learning_rate=5e-2)
    watch = rltrl.watch(trainer, port=None)
    trainer.train()
    rltrl.unwatch(trainer)
    assert watch.errors.total() == 0, watch.errors.snapshot()
    rollouts = load_rollouts(out / ROLLOUTS_FILE)
    assert rollouts["input_ids"].shape[0] == 8 and int(rollouts["response_mask"].sum()) > 0
    assert torch.equal(rollouts["response_mask"] * rollouts["attention_mask"], rollouts["response_mask"])

    result = subprocess.run([sys.executable, "-m", "rlwatch.cli", "postmortem", str(out), "--json", "--probe"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["source"].startswith(f"TRL {out}") and "store" in doc["source"]
    assert doc["steps"] == [1, 3]
    probe = doc["probe"]
    assert [(r["step"], r["path"]) for r in probe] == [(s, str(out / f"checkpoint-{s}")) for s in (1, 2, 3)]
    assert all(r["error"] is None and r["mean_logp"] < 0 for r in probe)
    assert probe[0]["kl_to_next"] > 0 and probe[1]["kl_to_next"] > 0 and probe[2]["kl_to_next"] is None

    # The report a person reads shows the same, in the terminal and in markdown.
    result = subprocess.run([sys.executable, "-m", "rlwatch.cli", "postmortem", str(out), "--probe",
                             str(out / ROLLOUTS_FILE), "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Checkpoint probe" in result.stdout and f"{probe[0]['kl_to_next']:.4g}" in result.stdout
    markdown = (tmp_path / "report" / "postmortem.md").read_text()
    assert "## Checkpoint probe" in markdown and f"`{out / 'checkpoint-1'}`" in markdown
