"""Reward-hack acceptance: the scenario's `reverse` grader has a bug the policy learns to exploit.
The built-in detectors, given nothing but the name of that environment's independent checker,
flag it: its hack rate rises in /metrics and in the store while `copy` stays flat."""

from __future__ import annotations

import urllib.request
from dataclasses import replace

import pytest

import rlwatch
from rlwatch import hacks
from rlwatch.runs.store import StoreReader
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

EOS = 10


def reverse_checker(ep: hacks.Episode) -> bool:
    """The user's independent checker for `reverse`: the prompt's digits, reversed, then EOS."""
    digits = [t for t in ep.prompt_ids if t < 10]
    answer = []
    for t in ep.response_ids:
        if t == EOS:
            return answer == digits[::-1]
        answer.append(t)
    return False                                            # no EOS: truncated, not a pass


def test_builtin_detectors_flag_the_exploited_environment_only(tmp_path):
    from rlwatch.demo import WATCH_CONFIG
    from rlwatch.demo.scenario import SCENARIOS, run_scenario

    hacks.use_checker("reverse", reverse_checker)           # the only user code
    config = replace(SCENARIOS["hack"], seed=0)
    path = str(tmp_path / "hack.db")
    with rlwatch.Watch(run="hack", port=0, store=path, **WATCH_CONFIG) as watch:
        def on_step(info):
            episodes = [{k: v for k, v in ep.items() if k != "true_pass"} for ep in info.episodes]
            watch.observe(info.step, **info.fields, episodes=episodes)
            # The verdicts are exported with the step that collects them; waiting here for this step's
            # keeps the store's series step-aligned however slowly the detector process starts (a
            # loaded CI machine otherwise folds the first steps' verdicts into a late, hacked step).
            watch.hacks.flush()
        run_scenario(config, on_step=on_step)
        watch.hacks.flush()
        watch.observe(config.steps, mask=[[1]])
        text = urllib.request.urlopen(watch.url).read().decode()
        watch.flush()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def total(name, env, detector):
        labels = (("detector", detector), ("env", env), ("run", "hack"), ("run_instance", watch.run_instance))
        return samples.get((name, labels), 0.0)

    hacked = total("rlwatch_episodes_hacked_total", "reverse", "verifier_disagreement")
    judged = total("rlwatch_episodes_judged_total", "reverse", "verifier_disagreement")
    assert judged > 0 and hacked / judged > 0.3, (hacked, judged)
    copy_hacked = total("rlwatch_episodes_hacked_total", "copy", "degenerate_output")
    copy_judged = total("rlwatch_episodes_judged_total", "copy", "degenerate_output")
    assert copy_judged > 0 and copy_hacked / copy_judged < 0.02
    assert total("rlwatch_episodes_judged_total", "copy", "verifier_disagreement") == 0   # no checker there

    with StoreReader(path) as store:
        reverse = [v for _, v in store.series("hack", "env_hack_ratio", ("reverse", "verifier_disagreement"))]
        copy = [v for _, v in store.series("hack", "env_hack_ratio", ("copy", "degenerate_output"))]
        alerts = store.alerts("hack")
        examples = store.hack_examples("hack")
    quarter = len(reverse) // 4
    assert sum(reverse[:8]) / 8 < 0.1 and sum(reverse[-quarter:]) / quarter > 0.5       # it rose
    assert max(copy) < 0.1
    fired = {(a["name"], a["labels"].get("env")) for a in alerts if a["state"] == "firing"}
    assert ("RLWatchRewardHackRateRising", "reverse") in fired
    assert ("RLWatchRewardHackRateRising", "copy") not in fired
    assert examples and all(e["env"] == "reverse" for e in examples)
