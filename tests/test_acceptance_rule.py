"""The acceptance report's own rules, on synthetic inputs: how the KL bound is chosen from the
feasible interval, and when a hack counts as having taken hold."""

from __future__ import annotations

import math

from evaluation import acceptance
from evaluation.matrix import RunSpec


def test_kl_bound_is_the_geometric_midpoint_of_the_feasible_interval(monkeypatch):
    # Bars met strictly between a healthy page at 0.8 and a missed fault at 3.4 (what the tuning split
    # looks like); the grid alone finds 1 and 2, the old rule (median, lower of two) took 1.
    evaluated = []

    def meets(traces, fixed, kl, tried):
        evaluated.append(kl)
        tried.append({"kl_k3_max": kl})
        return 0.8 < kl < 3.4

    monkeypatch.setattr(acceptance, "_meets_bars", meets)
    grid = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
    chosen = acceptance._midpoint([], {}, grid, [1.0, 2.0], [])
    assert math.isclose(chosen, math.sqrt(0.8 * 3.4), rel_tol=0.06), chosen
    assert all(0.5 < kl < 5.0 for kl in evaluated)


def test_kl_bound_falls_back_to_the_grid_when_the_midpoint_misses(monkeypatch):
    monkeypatch.setattr(acceptance, "_meets_bars", lambda traces, fixed, kl, tried: kl in (1.0, 2.0))
    assert acceptance._midpoint([], {}, (0.5, 1.0, 2.0, 5.0), [1.0, 2.0], []) == 1.0


def test_kl_bound_at_the_grid_end_keeps_that_edge(monkeypatch):
    monkeypatch.setattr(acceptance, "_meets_bars", lambda traces, fixed, kl, tried: kl > 0.9)
    chosen = acceptance._midpoint([], {}, (0.5, 1.0, 2.0, 5.0), [1.0, 2.0, 5.0], [])
    assert math.isclose(chosen, math.sqrt(0.9 * 5.0), rel_tol=0.06), chosen


def _hack_trace(hacked_per_step: list[int]) -> dict:
    spec = RunSpec("transformer", "hack", 99, steps=len(hacked_per_step))
    env = spec.buggy_env
    steps = [(i, {"step": {(): float(i)},
                  "episodes_judged_total": {(env, "verifier_disagreement"): 128.0},
                  "episodes_hacked_total": {(env, "verifier_disagreement"): float(k)}})
             for i, k in enumerate(hacked_per_step)]
    return {"spec": spec, "steps": steps, "heldout": None}


def test_a_hack_that_shows_only_in_the_last_step_has_not_taken_hold():
    # 75 of 128 episodes hacked in the last step only: no 10-step window reaches the hold rate, and no
    # pager could have seen it before the run ended.
    late = acceptance.replay(_hack_trace([0] * 39 + [75]), {})
    assert not late.hack_took_hold
    held = acceptance.replay(_hack_trace([0] * 20 + [40] * 20), {})
    assert held.hack_took_hold


def _outcome(kind: str, envs: list[str], took_hold: bool = False) -> acceptance.Outcome:
    spec = RunSpec("gru", {"hack": "hack", "healthy": "healthy_lag0"}[kind], 99)
    events = [acceptance.Event("RLWatchRewardHackRateRising", "critical", "firing", 20,
                               {"env": env, "detector": "verifier_disagreement"}, 0.3) for env in envs]
    return acceptance.Outcome(run=spec.name, family=spec.family, scenario=spec.scenario, kind=kind, seed=99,
                              steps=50, collapse_step=None, events=events, hack_took_hold=took_hold)


def test_hack_alert_scoring_blames_only_sound_graders():
    buggy = RunSpec("gru", "hack", 99).buggy_env
    # on the buggy grader below the hold rate: not false; on a sound grader or a run without the bug: false
    assert acceptance.score([_outcome("hack", [buggy])])["hack_alert_on_a_sound_grader"] == 0
    assert acceptance.score([_outcome("hack", ["copy"])])["hack_alert_on_a_sound_grader"] == 1
    assert acceptance.score([_outcome("healthy", [buggy])])["hack_alert_on_a_sound_grader"] == 1
    s = acceptance.score([_outcome("hack", [buggy], took_hold=True), _outcome("hack", [], took_hold=True)])
    assert (s["hack_took_hold"], s["hack_buggy_env_only"]) == (2, 1)
    assert not acceptance.bars(s)["hack alert on the hacked environment only"]
