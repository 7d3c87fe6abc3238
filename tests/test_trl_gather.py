"""TRL integration over several processes (rank 0 of two, the collectives stood in): episode data and
the hack detectors' episodes gathered as TRL gathers its own."""

from __future__ import annotations

import math

import pytest
import torch

import rlwatch

from .conftest import need_module

need_module("trl")

from rlwatch.integrations import trl as rltrl  # noqa: E402

from ._trl_tiny import EOS, PAD  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


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
