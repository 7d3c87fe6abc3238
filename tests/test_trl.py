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
import math
import time
import urllib.request
from collections import defaultdict

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import rlwatch
from rlwatch.core.metrics import BY_NAME
from rlwatch.signals import SignalConfig
from rlwatch.runs.store import StoreReader

from tests.conftest import need_module

need_module("trl")

from rlwatch.integrations import trl as rltrl  # noqa: E402

from tests._trl_tiny import EOS, PAD, REWARD_FUNCS, build_tiny_model, make_trainer, prompt_env  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
EPISODE_LEVEL = rltrl.GENERATION_FAMILIES | rltrl.STEP_EPISODE_FAMILIES


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


# --- the test's own tap on TRL ------------------------------------------------------------------------

class Tap:
    """Records, per ``_compute_loss`` call, the inputs TRL trained on, the policy's per-token log-probs
    and entropies and the global step; per generation batch, TRL's scored output and the step."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.micro: list[dict] = []
        self.gens: list[dict] = []
        self._in_loss = False
        self._policy = None
        generate, loss, logps = (trainer._generate_and_score_completions, trainer._compute_loss,
                                 trainer._get_per_token_logps_and_entropies)

        def tap_generate(inputs):
            out = generate(inputs)
            if trainer.model.training:
                self.gens.append(dict(output=dict(out), version=trainer.state.global_step,
                                      step=trainer.state.global_step + 1))
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
                                       gen_step=self.gens[-1]["version"]))
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

    def generations(self) -> dict[int, list[tuple[int, dict]]]:
        """(serial, batch) of the generation batches by the optimizer step that scored them."""
        out: dict[int, list[tuple[int, dict]]] = defaultdict(list)
        for serial, g in enumerate(self.gens, start=1):
            out[g["step"]].append((serial, g))
        return dict(out)


def rewards_of(texts: list[str], envs: list[str], funcs=REWARD_FUNCS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per function [N, F] (None -> NaN) and the weighted reward TRL computes (weights 1; nansum;
    all-None -> NaN)."""
    per_func = torch.tensor([[math.nan if r is None else r for r in f(completions=texts, environment=envs)]
                             for f in funcs], dtype=torch.float64).T
    total = per_func.nansum(1)
    total[torch.isnan(per_func).all(1)] = math.nan
    return per_func, total


def expected_step_fields(micro: list[dict], trainer) -> dict:
    """One step's token-level observe fields rebuilt from the tap, independently of the integration."""
    width = max(m["inputs"]["completion_mask"].shape[1] for m in micro)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    masks, trainer_lp, sampler_lp, entropy, versions = [], [], [], [], []
    for m in micro:
        inp = m["inputs"]
        old = inp.get("old_per_token_logps")
        masks.append(pad(inp["completion_mask"]))
        trainer_lp.append(pad(old if old is not None else m["logps"]))      # TRL's own pi_old
        if inp.get("sampling_per_token_logps") is not None:
            sampler_lp.append(pad(inp["sampling_per_token_logps"]))
        entropy.append(pad(m["entropy"]))
        versions += [m["gen_step"]] * inp["completion_mask"].shape[0]
    fields = dict(mask=torch.cat(masks), trainer_logp=torch.cat(trainer_lp), entropy=torch.cat(entropy),
                  seq_version=torch.tensor(versions), trainer_version=micro[-1]["global_step"],
                  temperature=trainer.args.temperature, top_p=trainer.args.top_p, top_k=trainer.args.top_k)
    if sampler_lp:
        fields["sampler_logp"] = torch.cat(sampler_lp)
    return fields


def decode_batch(g: dict, trainer, funcs) -> dict:
    """One generation batch as the test reads it: texts, environments, lengths, truncation, rewards."""
    tokenizer, envs_of = trainer.processing_class, prompt_env()
    out = g["output"]
    texts, envs, lengths, truncated = [], [], [], []
    for b in range(out["completion_ids"].shape[0]):
        n = int(out["completion_mask"][b].sum())
        ids = out["completion_ids"][b, :n].tolist()
        prompt = tokenizer.decode(out["prompt_ids"][b][out["prompt_mask"][b].bool()], skip_special_tokens=True)
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
        envs.append(envs_of[prompt])
        lengths.append(n)
        truncated.append(ids[-1] not in (EOS, PAD))
    per_func, rewards = rewards_of(texts, envs, funcs)
    return dict(texts=texts, env=envs, lengths=lengths, truncated=truncated, per_func=per_func, rewards=rewards)


def expected_generation_fields(batches: list[tuple[int, dict]], trainer, funcs) -> dict:
    """The episode-level record of the generation batches one step scored (groups: consecutive blocks of
    num_generations rows of each batch, TRL's RepeatSampler order before its shuffle)."""
    G = trainer.num_generations
    lengths, rewards, truncated, env, group_ids = [], [], [], [], []
    for serial, g in batches:
        d = decode_batch(g, trainer, funcs)
        lengths += d["lengths"]
        rewards.append(d["rewards"])
        truncated += d["truncated"]
        env += d["env"]
        group_ids += [f"{serial}/{b // G}" for b in range(len(d["lengths"]))]
    lengths_t = torch.tensor(lengths)
    rewards_t = torch.cat(rewards)
    return dict(mask=torch.arange(max(lengths)).unsqueeze(0) < lengths_t.unsqueeze(1), rewards=rewards_t,
                group_ids=group_ids, truncated=torch.tensor(truncated), env=env,
                failed=[None if not math.isnan(r) else "unscorable" for r in rewards_t.tolist()])


def expected_rows(tap: Tap, trainer, config: SignalConfig, funcs=REWARD_FUNCS) -> dict[int, dict]:
    """Per optimizer step: the token-level values of its micro-batches, and the episode-level values of
    the batches it scored (with their counters), or of the latest batch before it (gauges only)."""
    gens = tap.generations()
    out: dict[int, dict] = {}
    last: dict | None = None
    for s, micro in sorted(tap.steps().items()):
        token = rlwatch.compute(config=config, step=s, **expected_step_fields(micro, trainer))
        values = {k: v for k, v in token.items() if k not in EPISODE_LEVEL and not k.startswith("_")}
        if s in gens:
            episode = rlwatch.compute(config=config, step=s, **expected_generation_fields(gens[s], trainer, funcs))
            last = {k: v for k, v in episode.items() if k in rltrl.GENERATION_FAMILIES}
            last["generation"] = {(): float(gens[s][-1][0])}
            last["generation_policy_version"] = {(): float(gens[s][-1][1]["version"])}
            values.update(last)
        else:
            assert last is not None
            values.update({k: v for k, v in last.items() if BY_NAME[k].kind != "counter"})
        out[s] = values
    return out


# --- scraping and comparing ---------------------------------------------------------------------------

def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Samples keyed by name and labels, run_instance left out: one process per run in these tests."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run_instance"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return parse(resp.read().decode())


def exposition(watch) -> dict[tuple[str, tuple], float]:
    """What /metrics serves, rendered from the Watch's registry without a server."""
    return parse(generate_latest(watch.registry).decode())


def sample(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def assert_row_matches(row, expected: dict) -> int:
    """Every value rlwatch.compute gives equals the stored one, and nothing episode-level is missing."""
    checked = 0
    for name, family in expected.items():
        for labels, value in family.items():
            got = row.get(name, labels)
            if value is None or not math.isfinite(value):
                assert got is None, (row.step, name, labels, got)
            else:
                assert got == pytest.approx(value, rel=1e-9, abs=1e-12), (row.step, name, labels, got, value)
            checked += 1
    for name in rltrl.GENERATION_FAMILIES - {"env_failure_ratio", "episodes_failed_total", "env_reward_length_corr"}:
        if BY_NAME[name].kind == "gauge":
            assert name in row.values, (row.step, name)
    return checked


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
    """Without the timing keys and without the headline signals rlwatch adds (``rlwatch/``)."""
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS and not k.startswith("rlwatch/")} for h in history]


def assert_agrees_with_trl(rows: dict, scalars: dict, tap: Tap, trainer, funcs=REWARD_FUNCS) -> int:
    """On every step at which TRL scored generation batches, rlwatch's episode-level values equal TRL's
    logged ones for the same episodes. TRL logs the mean over the step's batches of per-batch values;
    the batches of one step have equal sizes, so the pooled fractions and means equal those means
    except where per-batch counts differ (function means over non-None rewards, lengths' maxima),
    which are compared on steps that scored one batch. TRL counts a group that no reward function
    could score as a group of non-zero std; rlwatch leaves unscorable episodes out (failed)."""
    logs, gens = trl_logs(trainer), tap.generations()
    compared = 0
    for s, batches in gens.items():
        row, log = rows[s], logs[s]
        decoded = [decode_batch(g, trainer, funcs) for _, g in batches]
        n = sum(len(d["lengths"]) for d in decoded)
        scorable = sum(int((~torch.isnan(d["rewards"])).sum()) for d in decoded)
        zero = row.get("zero_gradient_episodes_ratio")
        assert (zero or 0.0) * scorable / n == pytest.approx(log["frac_reward_zero_std"], abs=1e-12), s
        assert row.get("truncated_ratio") == pytest.approx(log["completions/clipped_ratio"], abs=1e-12), s
        assert row.get("response_length_mean") == pytest.approx(log["completions/mean_length"], rel=1e-6), s
        if scorable:
            assert row.get("reward_mean") == pytest.approx(log["reward"], rel=1e-6), s
        if len(batches) == 1:
            assert row.get("response_length_max") == log["completions/max_length"], s
            for f in funcs:
                key = f"rewards/{f.__name__}/mean"
                if math.isnan(log[key]):
                    assert s not in dict(scalars.get(f"rlwatch/{key}", [])), s
                else:
                    assert dict(scalars[f"rlwatch/{key}"])[s] == pytest.approx(log[key], rel=1e-6), (s, key)
        compared += 1
    assert compared == len(gens) > 0
    return compared


# --- one real training, checked end to end -----------------------------------------------------------

def run_and_check(model_path, out_dir, run: str, *, funcs=None, rollout: bool = False, watch_options=None,
                  **config):
    """Train with the tap and rlwatch, then check every stored step against the rebuilt records, the
    episode-level values against TRL's logs, the counters, /metrics and the counted reasons."""
    funcs = funcs or REWARD_FUNCS
    trainer = make_trainer(model_path, out_dir / "out", rollout=rollout, reward_funcs=funcs, **config)
    tap = Tap(trainer)
    store = str(out_dir / f"{run}.db")
    options = dict(run=run, port=None, store=store, **(watch_options or {}))
    watch = rltrl.watch(trainer, **options)
    trainer.train()
    watch.flush()
    signal_config = SignalConfig(group_size=trainer.num_generations, is_cap=watch.signal_config.is_cap,
                                 mis_band=watch.signal_config.mis_band)
    expected = expected_rows(tap, trainer, signal_config, funcs)
    with StoreReader(store) as reader:
        rows = {row.step: row for row in reader.steps(run)}
        scalars = reader.scalars(run)
    assert sorted(rows) == sorted(expected) == list(range(1, trainer.state.global_step + 1))
    for s in rows:
        assert assert_row_matches(rows[s], expected[s]) > 30
    assert_agrees_with_trl(rows, scalars, tap, trainer, funcs)

    # Counters count each generation batch once, however many steps train on it.
    N = sum(g["output"]["completion_ids"].shape[0] for g in tap.gens)
    G = trainer.num_generations
    metrics = exposition(watch)
    assert sum(v for (name, _), v in metrics.items() if name == "rlwatch_episodes_total") == N
    groups = sum((e.get("groups_total") or {}).get((), 0.0) for e in expected.values())
    assert sample(metrics, "rlwatch_groups_total", run=run) == groups
    scorable = sum(int((~torch.isnan(decode_batch(g, trainer, funcs)["rewards"])).sum()) for g in tap.gens)
    assert groups == (N // G if scorable == N else scorable // G)     # unscorable groups are no groups
    assert sample(metrics, "rlwatch_generation", run=run) == len(tap.gens)
    assert sample(metrics, "rlwatch_generation_policy_version", run=run) == tap.gens[-1]["version"]
    steps = trainer.state.global_step
    sampler = rollout
    unavailable = {labels: v for (name, labels), v in metrics.items() if name == "rlwatch_signal_unavailable_total"}
    key = (("reason", "no_sampler_logprobs"), ("run", run), ("signal", "mismatch"))
    if sampler:
        assert key not in unavailable
        assert ("rlwatch_mismatch_kl_k3", (("run", run),)) in metrics
    else:
        assert unavailable[key] == steps                  # counted once per step, never a silent gap
        assert ("rlwatch_mismatch_kl_k3", (("run", run),)) not in metrics
    assert watch.errors.total() == 0, watch.errors.snapshot()
    rltrl.unwatch(trainer)
    return trainer, tap, rows, scalars


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


def test_split_generation_batch_through_the_callback(model_path, tmp_path):
    """A user-made Watch passed as callbacks=[RLWatchCallback(watch)] attaches at train begin.
    steps_per_generation=2 > gradient_accumulation_steps=1: the second half of each generation batch
    is trained one update later (lag 1); the group signals still come from the whole batch, once."""
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
    assert [r.get("groups") for r in rows] == [4.0, 4.0] and [r.get("groups_total") for r in rows] == [4.0, None]
    assert [r.get("generation") for r in rows] == [1.0, 1.0]
    assert callback.trainer is trainer and rltrl.watch(trainer) is watch    # attached through the stack
    rltrl.unwatch(trainer)
    assert callback in trainer.callback_handler.callbacks                   # the user's callback stays
    assert not watch._closed                                                # and so does the user's Watch
    watch.close()


@pytest.mark.slow
def test_phases_come_from_trls_own_timing_points(model_path, tmp_path):
    """The training phase is TRL's ``training_step`` time (the sum TRL logs as ``step_time``), the
    generation phase its ``profiling_context`` generate block, on the step that generated (TRL 1.16
    generates once per generation batch); stored and exported per step, and restored on unwatch."""
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.profiling_context
    store = str(tmp_path / "run.db")
    trainer = make_trainer(model_path, tmp_path / "out", steps_per_generation=2, max_steps=2)
    watch = rltrl.watch(trainer, run="trl-phases", port=None, store=store)
    assert grpo_module.profiling_context is not original
    trainer.train()
    watch.flush()
    with StoreReader(store) as reader:
        rows = {row.step: row for row in reader.steps("trl-phases")}
    logs = {h["step"]: h for h in trainer.state.log_history if "step_time" in h}
    for step in (1, 2):
        assert rows[step].get("phase_seconds", ("training",)) == pytest.approx(logs[step]["step_time"], abs=0.05)
        assert rows[step].get("phase_seconds_total", ("training",)) == rows[step].get("phase_seconds", ("training",))
    assert rows[1].get("phase_seconds", ("generation",)) > 0                  # generated at step 1 only
    assert rows[2].get("phase_seconds", ("generation",)) is None
    assert rows[1].get("weight_sync_seconds") is None                        # no vLLM: nothing to sync
    rltrl.unwatch(trainer)
    assert grpo_module.profiling_context is original

    # The vLLM path (rollout_func, TRL's sync_weights block around a stand-in engine's sync).
    trainer = make_trainer(model_path, tmp_path / "out-vllm", rollout=True, max_steps=1)
    slow_sync = trainer.vllm_generation.sync_weights = lambda: time.sleep(0.05)
    watch = rltrl.watch(trainer, run="trl-sync", port=None, store=store)
    trainer.train()
    watch.flush()
    with StoreReader(store) as reader:
        row = reader.steps("trl-sync")[0]
    assert slow_sync and 0.05 <= row.get("weight_sync_seconds") == row.get("phase_seconds", ("sync",)) < 1.0
    rltrl.unwatch(trainer)


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
    from rlwatch.integrations import _instrumentor

    monkeypatch.setattr(_instrumentor, "installed_version", lambda package: "1.17.0")
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

    trainer = SimpleNamespace(train_dataset=SimpleNamespace(column_names=["prompt", "data_source"]))
    assert rltrl.env_labels_present(trainer)
    trainer.train_dataset.column_names = ["prompt"]
    assert not rltrl.env_labels_present(trainer)
    from rlwatch.integrations._tensors import pad_cat

    padded = pad_cat([torch.ones(2, 3), torch.ones(1, 5)], 5)
    assert padded.shape == (3, 5) and padded[:2, 3:].eq(0).all() and padded[2].eq(1).all()


def test_episode_data_is_gathered_over_processes(monkeypatch):
    """Rank 0 of two: the generation batch's episode data (truncation, lengths counting only the
    model's tokens when a tool_mask is present, environment labels) is gathered as TRL gathers its
    own, and the group ids span the whole batch. The collectives are stand-ins that return this
    rank's rows followed by the other rank's (the CPU tests run one process)."""
    import accelerate.utils
    from types import SimpleNamespace

    other = {"table": torch.tensor([[1, 3], [0, 2]]), "env": ["code", "code"]}
    calls = []

    def gather(t):
        calls.append("gather")
        return torch.cat([t, other["table"]])

    def gather_object(items):
        calls.append("gather_object")
        return list(items) + other["env"]

    monkeypatch.setattr(accelerate.utils, "gather_object", gather_object)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), state=SimpleNamespace(global_step=5), num_generations=2,
        accelerator=SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"), gather=gather),
        eos_token_ids=[EOS], _tokenizer=SimpleNamespace(pad_token_id=PAD), reward_weights=torch.tensor([1.0, 2.0]),
        reward_func_names=["a", "b"], train_dataset=SimpleNamespace(column_names=["prompt", "environment"]),
        args=SimpleNamespace(steps_per_generation=1))
    watch = rlwatch.Watch(run="trl-gather", port=None, store=None, hack_detectors=False, strict=True)
    instrumentor = rltrl.GRPOInstrumentor(trainer, watch)
    rewards = torch.tensor([[1.0, 0.0], [1.0, math.nan], [math.nan, math.nan], [0.5, 0.5]])   # both ranks' rows
    instrumentor._on_rewards([{"environment": "math"}] * 2, [[5, 6, 7, EOS], [5, 6, 7, 8, 9]], rewards)
    tool_mask = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 0, 0, 1]])          # padded with 1 past each completion
    output = {"completion_ids": torch.zeros(2, 5, dtype=torch.long), "tool_mask": tool_mask}
    instrumentor._gather_episodes(output)
    instrumentor._on_generation(output)
    assert calls == ["gather", "gather_object"]
    (g,) = instrumentor.capture.generations
    assert g.truncated.tolist() == [False, True, True, False]
    assert g.lengths.tolist() == [3, 3, 3, 2]                  # this rank's: model tokens within each length
    assert g.env == ["math", "math", "code", "code"]
    assert g.group_ids.tolist() == [0, 0, 1, 1] and g.version == 5 and g.serial == 1
    assert g.rewards[:2].tolist() == [1.0, 1.0] and math.isnan(g.rewards[2]) and g.rewards[3] == 1.5
    assert g.failed == [None, None, "unscorable", None]
    assert output[rltrl.VERSION_KEY].tolist() == [5, 5]
    values = instrumentor.generation_values(6, [g])
    assert values["groups"][()] == 2 and values["env_episodes"] == {("math",): 2.0, ("code",): 2.0}
    assert values["truncated_ratio"][()] == 0.5 and values["generation"][()] == 1
    assert instrumentor.listener.unavailable == {}

    # What a batch cannot give is counted with its reason, and the step still gets every family.
    bare = rltrl.Generation(serial=2, version=6, rewards=torch.full((2,), math.nan),
                            per_func=torch.full((2, 1), math.nan), func_names=["a"],
                            truncated=torch.zeros(2, dtype=torch.bool), lengths=torch.tensor([2, 3]),
                            group_ids=torch.tensor([4, 4]), env=None)
    instrumentor.listener.submit(instrumentor.generation_values(7, [bare]))
    extra = instrumentor.listener.on_step(7, {"env_episodes": {("default",): 2.0}})
    assert extra["signal_unavailable_total"] == {("env", "no_environment_column"): 1.0,
                                                 ("reward", "all_unscorable"): 1.0}
    assert extra["generation"] == {(): 2.0} and extra["env_episodes"] == {("default",): 2.0}
    assert extra["groups"] == {(): 0.0} and extra["reward_mean"] == {(): None}
    again = instrumentor.listener.on_step(8, {})                 # no new batch: gauges again, no counters
    assert again["generation"] == {(): 2.0}
    assert "episodes_total" not in again and "signal_unavailable_total" not in again
    watch.close()


def test_hack_episodes_gathered_over_processes_and_a_missing_share_counted(monkeypatch):
    """Rank 0 of two, collectives stood in (the real two-process run: tests/test_trl_multiprocess.py):
    the episodes of both processes reach the detectors once, in process order, with each process's
    rows, verdicts and labels; a process whose share could not be captured is counted, not waited for."""
    import accelerate.utils
    from types import SimpleNamespace

    shares: list = []
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda items: list(items) + shares)
    checker = rltrl.audited(lambda prompts, completions, **kw: [1.0] * len(completions),
                            lambda prompts, completions, **kw: [True, False], name="graded")
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), state=SimpleNamespace(global_step=3), reward_funcs=[checker],
        accelerator=SimpleNamespace(num_processes=2, process_index=0), eos_token_ids=[EOS],
        _tokenizer=SimpleNamespace(pad_token_id=PAD), reward_weights=torch.tensor([2.0]), reward_func_names=["graded"])
    watch = rlwatch.Watch(run="trl-hack-gather", port=None, store=None)
    submitted = []
    monkeypatch.setattr(watch, "submit_episodes", lambda step, episodes, env=None: submitted.append((step, episodes)))
    instrumentor = rltrl.GRPOInstrumentor(trainer, watch)
    instrumentor._processes = 2
    checker(["p0", "p1"], ["a b", "c"])
    rewards = torch.tensor([[1.0], [0.0], [math.nan], [1.0]])                 # both processes' rows (TRL's gather)
    instrumentor._on_rewards([{"environment": "math"}] * 2, [[5, 6], [7, EOS]], rewards, ["p0", "p1"], ["a b", "c"])
    shares.append((["p2", "p3"], ["d", "e f"], [[8], [9, 10]], [[math.nan], [1.0]], [True, True], ["code", "code"],
                   [None, True]))
    instrumentor._gather_hack_episodes()
    (step, episodes), = submitted
    assert step == 3 and [e["prompt"] for e in episodes] == ["p0", "p1", "p2", "p3"]
    assert [e["env"] for e in episodes] == ["math", "math", "code", "code"]
    assert [e["reward"] for e in episodes] == [2.0, 0.0, 0.0, 2.0]
    assert [e["truncated"] for e in episodes] == [True, False, True, True]
    assert [e["extra"].get("true_pass") for e in episodes] == [True, False, None, True]
    assert [e["response_ids"] for e in episodes] == [[5, 6], [7, EOS], [8], [9, 10]]
    assert "episode_inputs" not in instrumentor.capture.rewards           # taken by the gather, once

    # The other process captured nothing this time: this process's episodes are judged, the gap counted.
    shares[:] = [None]
    instrumentor._on_rewards([{"environment": "math"}] * 2, [[5, 6], [7, EOS]], rewards, ["p0", "p1"], ["a b", "c"])
    instrumentor._gather_hack_episodes()
    assert [e["prompt"] for e in submitted[-1][1]] == ["p0", "p1"]
    assert watch.errors.snapshot() == {("integration", "trl_hack_gather"): 1}
    watch.close()


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

    result = subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", str(out), "--json", "--probe"],
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
    result = subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", str(out), "--probe",
                             str(out / ROLLOUTS_FILE), "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Checkpoint probe" in result.stdout and f"{probe[0]['kl_to_next']:.4g}" in result.stdout
    markdown = (tmp_path / "report" / "postmortem.md").read_text()
    assert "## Checkpoint probe" in markdown and f"`{out / 'checkpoint-1'}`" in markdown
