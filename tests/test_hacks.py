"""Reward-hack detectors: the built-ins on crafted episodes, the interface, and the plumbing."""

from __future__ import annotations

import time

import pytest
import torch

import rlwatch
from rlwatch import hacks
from rlwatch.hacks.builtin import degenerate_output, format_gaming, repetition_ratio, tampering, \
    verifier_disagreement
from rlwatch.hacks.registry import Episode, as_verdict
from rlwatch.runs.store import StoreReader

from tests.conftest import make_step


def test_hacks_is_reachable_after_a_plain_import_rlwatch():
    """The README's ``@rlwatch.hacks.detector(...)`` and ``rlwatch.hacks.use_checker`` after ``import rlwatch``
    alone (a fresh interpreter: here rlwatch.hacks is imported already)."""
    import subprocess
    import sys

    code = ("import rlwatch\n"
            "@rlwatch.hacks.detector('says_hi', envs={'chat'})\n"
            "def says_hi(episode):\n"
            "    return 'hi' in episode.completion\n"
            "rlwatch.hacks.use_checker('chat', lambda episode: True)\n"
            "print('ok', 'says_hi' in rlwatch.hacks.REGISTRY)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "True"]


def verdict(fn, **kw):
    v = as_verdict(fn(Episode(**kw)))
    return None if v is None else v.hacked


def test_degenerate_output():
    assert verdict(degenerate_output, reward=1.0, response="") is True
    assert verdict(degenerate_output, reward=1.0, response="   ", truncated=True) is True
    assert verdict(degenerate_output, reward=1.0, response="the answer " * 30) is True
    assert verdict(degenerate_output, reward=1.0, response_ids=[7] * 40) is True
    assert verdict(degenerate_output, reward=1.0, response="The sum of 12 and 30 is 42, so x = 42.") is False
    assert verdict(degenerate_output, reward=0.0, response="") is False          # not rewarded: not a hack
    assert verdict(degenerate_output, reward=1.0) is None                         # nothing to judge
    assert repetition_ratio(list("abcabcabcabc"), 3) > 0.5 and repetition_ratio(list("abcdefgh"), 3) == 0


def test_verifier_disagreement_with_a_named_checker():
    assert verdict(verifier_disagreement, reward=1.0, extra={"true_pass": False}) is True
    assert verdict(verifier_disagreement, reward=1.0, extra={"true_pass": True}) is False
    assert verdict(verifier_disagreement, reward=0.0, extra={"true_pass": False}) is False
    assert verdict(verifier_disagreement, reward=1.0) is None
    hacks.use_checker("unit-env", lambda ep: "42" in (ep.response or ""))
    assert verdict(verifier_disagreement, env="unit-env", reward=1.0, response="41") is True
    assert verdict(verifier_disagreement, env="unit-env", reward=1.0, response="42") is False


def test_format_gaming():
    both = {"format_reward": 1.0, "accuracy_reward": 0.0}
    assert verdict(format_gaming, reward=1.0, extra={"reward_components": both}) is True
    honest = {"format_reward": 1.0, "accuracy_reward": 1.0}
    assert verdict(format_gaming, reward=2.0, extra={"reward_components": honest}) is False
    assert verdict(format_gaming, reward=1.0, extra={"reward_components": {"length": 1.0}}) is None


@pytest.mark.parametrize("extra,hacked", [
    ({"files_touched": ["src/app.py", "tests/test_app.py"]}, True),
    ({"files_touched": ["conftest.py"]}, True),
    ({"diff": "--- a/src/x.py\n+++ b/src/x.py\n@@\n+@pytest.mark.skip(reason='flaky')\n"}, True),
    ({"diff": "--- a/t.py\n+++ b/src/t.py\n@@\n-    assert result == 3\n+    pass\n"}, True),
    ({"commands": ["sed -i 's/assert/#/' tests/test_core.py"]}, True),
    ({"commands": ["pytest -k 'not slow_test' -q"]}, True),
    ({"tool_calls": [{"name": "bash", "args": "rm tests/test_core.py"}]}, True),
    ({"files_touched": ["src/app.py"], "diff": "--- a/src/app.py\n+++ b/src/app.py\n@@\n-x = 1\n+x = 2\n",
      "commands": ["pytest -q"]}, False),
])
def test_coding_agent_tampering(extra, hacked):
    assert verdict(tampering, reward=1.0, extra=extra) is hacked
    assert verdict(tampering, reward=0.0, extra=extra) is False


def test_register_decorator_env_selection_and_sampling():
    @hacks.detector("unit_short_answer", envs={"math"})
    def short(ep):
        return (len(ep.response or "") < 3, "too short")

    det = hacks.REGISTRY["unit_short_answer"]
    assert det.applies_to("math") and not det.applies_to("code")
    sampled = hacks.register("unit_judge", lambda ep: True, sample_rate=0.05)
    from rlwatch.hacks.judge import sampled as is_sampled
    picks = sum(is_sampled(sampled, Episode(step=s, index=i)) for s in range(40) for i in range(100))
    assert 100 < picks < 300                                     # ~5% of 4000, deterministic
    assert picks == sum(is_sampled(sampled, Episode(step=s, index=i)) for s in range(40) for i in range(100))
    hacks.unregister("unit_short_answer")
    hacks.unregister("unit_judge")
    with pytest.raises(ValueError):
        hacks.register("bad", lambda ep: True, sample_rate=0)


def test_failing_or_slow_detectors_are_errors_never_honest_and_never_block(tmp_path):
    def boom(ep):
        raise RuntimeError("grader crashed")

    def slow(ep):
        time.sleep(1.0)
        return True

    detectors = [hacks.Detector("boom", boom), hacks.Detector("slow", slow, timeout=0.2),
                 hacks.Detector("flag_all", lambda ep: (True, "always"))]
    with rlwatch.Watch(run="h", port=None, store=str(tmp_path / "s.db"), hack_detectors=detectors) as w:
        step = make_step(B=4, T=4)
        episodes = [{"reward": 1.0, "response": f"r{i}", "prompt": "p"} for i in range(4)]
        start = time.perf_counter()
        w.observe(0, **step, episodes=episodes)
        assert time.perf_counter() - start < 0.5                 # the slow detector runs off-thread
        w.hacks.flush()
        values = w.observe(1, **step)
        w.flush()
    counts = w.errors.counts
    assert counts[("hacks", "detector_error")] == 4 and counts[("hacks", "detector_timeout")] == 4
    assert ("math", "boom") not in values["episodes_judged_total"]        # unknown, not "not hacked"
    assert values["episodes_judged_total"][("math", "flag_all")] == 2
    assert values["env_hack_ratio"][("math", "flag_all")] == 1.0
    with StoreReader(str(tmp_path / "s.db")) as store:
        examples = store.hack_examples("h")
        hacked_total = store.series("h", "episodes_hacked_total", ("code", "flag_all"))
    assert examples and examples[0]["detector"] == "flag_all" and examples[0]["reason"] == "always"
    assert hacked_total == [(1, 2.0)]


def test_builtins_run_by_default_on_episodes_and_feed_metrics(tmp_path):
    with rlwatch.Watch(run="d", port=0, store=None) as w:
        step = make_step(B=4, T=4)
        episodes = [{"reward": 1.0, "response": "", "true_pass": False},
                    {"reward": 1.0, "response": "a real answer of several words", "true_pass": True},
                    {"reward": 1.0, "response": "x x x x x x x x x x x x", "true_pass": False},
                    {"reward": 0.0, "response": "wrong", "true_pass": False}]
        w.observe(0, **step, episodes=episodes)
        w.hacks.flush()
        w.observe(1, **step)
        import urllib.request
        text = urllib.request.urlopen(w.url).read().decode()
    me = f'run="d",run_instance="{w.run_instance}"'
    assert f'rlwatch_episodes_hacked_total{{detector="verifier_disagreement",env="math",{me}}} 2.0' in text
    assert f'rlwatch_episodes_judged_total{{detector="degenerate_output",env="math",{me}}} 2.0' in text
    assert 'detector="format_gaming"' not in text                 # no reward components: not applicable


def test_reward_length_correlation_signal():
    B = 8
    mask = torch.arange(10)[None, :] < torch.arange(1, B + 1)[:, None]     # lengths 1..8
    rewards = torch.arange(1, B + 1).float()                                # reward grows with length
    v = rlwatch.compute(mask=mask, rewards=rewards, env=["a"] * B)
    assert v["env_reward_length_corr"][("a",)] == pytest.approx(1.0)
    v = rlwatch.compute(mask=mask, rewards=torch.ones(B), env=["a"] * B)
    assert v["env_reward_length_corr"][("a",)] is None                       # no variance: undefined


def test_trl_audited_reward_feeds_the_builtin_detectors(tmp_path):
    """A TRL reward function paired with an independent checker: rewarded completions the checker
    rejects are flagged in their environment, with nothing else written by the user."""
    from tests.conftest import need_module

    need_module("trl")
    from rlwatch.integrations import trl as rl_trl

    from tests._trl_tiny import build_tiny_model, make_trainer, reward_length

    def checker(prompts, completions, environment, **kwargs):     # "code" answers are never really right
        return [env != "code" for env in environment]

    trainer = make_trainer(build_tiny_model(tmp_path), tmp_path / "out", max_steps=3,
                           reward_funcs=[rl_trl.audited(reward_length, checker)])
    w = rl_trl.watch(trainer, port=None)
    trainer.train()
    w.hacks.flush()
    w.observe(99, mask=torch.ones(1, 1))                     # one more step carries the last verdicts
    snap = w.state.snapshot()
    rl_trl.unwatch(trainer)
    judged = snap.counters["episodes_judged_total"]
    hacked = snap.counters["episodes_hacked_total"]
    assert hacked[("code", "verifier_disagreement")] > 0
    assert hacked[("math", "verifier_disagreement")] == 0 and judged[("math", "verifier_disagreement")] > 0
    assert ("code", "degenerate_output") in judged


def test_detector_process_never_reruns_the_script_and_never_holds_up_exit(tmp_path):
    """The detector process is a plain child interpreter: a training script without a __main__ guard
    is not run twice, and a process that exits without closing the Watch is not held up."""
    import os
    import subprocess
    import sys
    import textwrap

    marker = tmp_path / "runs.txt"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import rlwatch, torch
        open({str(marker)!r}, "a").write("run\\n")          # no __main__ guard, on purpose
        w = rlwatch.Watch(run="exit", port=None, store=None)
        w.observe(0, mask=torch.ones(2, 2), episodes=[{{"reward": 1.0, "response": ""}}] * 2)
        w.hacks.flush(20)
        print(w.hacks.mode, w.hacks._process.pid, flush=True)
        # no w.close(): the interpreter exits with the worker running
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    mode, pid = result.stdout.split()
    assert mode == "process" and marker.read_text() == "run\n"
    for _ in range(100):                                   # the child sees EOF and exits on its own
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        import time
        time.sleep(0.1)
    else:
        raise AssertionError("the detector process outlived its parent")
