"""Shared by the TRL tests (tests/test_trl_*.py): the test's own tap on TRL's tensors, the records
rebuilt from it independently of the integration, scraping and comparing, and ``run_and_check``, one
real training checked end to end."""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import rlwatch
from rlwatch.integrations import trl as rltrl
from rlwatch.core.metrics import BY_NAME
from rlwatch.signals import SignalConfig
from rlwatch.runs.store import StoreReader

from ._trl_tiny import EOS, PAD, REWARD_FUNCS, make_trainer, prompt_env

TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
EPISODE_LEVEL = rltrl.GENERATION_FAMILIES | rltrl.STEP_EPISODE_FAMILIES


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
