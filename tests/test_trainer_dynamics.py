"""The trainer's dynamics as signals: the recognised names (rlwatch.core.trainer_keys), a run judged from
``Watch.log_scalars`` alone (the store's step rows, /metrics, the alert events), the join with
``observe`` for the same step (one verdict per step, no value lost) and the precursor alerts."""

from __future__ import annotations

import random
import sqlite3

import pytest
import torch
from prometheus_client import generate_latest

import rlwatch
from rlwatch.alerts.domains import dynamics
from rlwatch.alerts.windows import AlertWindows
from rlwatch.core.metrics import BY_NAME
from rlwatch.core.trainer_keys import SIGNALS, TRAINER_KEYS, recognise
from rlwatch.runs.store import StoreReader


# --- the table ----------------------------------------------------------------------------------

def test_every_exact_key_gives_its_signal_and_every_signal_is_in_the_catalogue():
    for entry in TRAINER_KEYS:
        assert entry.signal in BY_NAME, entry.signal
        if entry.key:
            assert recognise({entry.key: 0.25})[entry.signal] == 0.25
            assert recognise({"train/" + entry.key: 0.5})[entry.signal] == 0.5     # W&B's prefix
    assert set(SIGNALS) <= set(BY_NAME)


def test_patterns_priority_and_non_finite_values():
    row = {"val-core/gsm8k/acc/mean@4": 0.4, "val-core/math/acc/mean@4": 0.6, "val-aux/gsm8k/acc/std@4": 9.0,
           "critic/score/mean": 0.3, "critic/rewards/mean": 0.1, "eval_gsm8k_pass1": 0.2}
    got = recognise(row)
    assert got["heldout_score"] == pytest.approx(0.5)          # verl's: the mean over data sources
    assert got["reward_mean"] == 0.3                           # the score before the KL-penalised reward
    assert recognise({"eval_pass1": 0.7})["heldout_score"] == 0.7
    got = recognise({"grad_norm": float("nan"), "loss": float("inf"), "actor/grad_norm": 0.4})
    assert got == {"grad_norm_nonfinite": 1.0, "loss_nonfinite": 1.0}
    assert recognise({"grad_norm": torch.tensor(0.0)}) == {"grad_norm": 0.0, "grad_norm_nonfinite": 0.0,
                                                           "grad_norm_zero": 1.0}
    assert recognise({"rollout_corr/k3_kl": 0.01, "training/rollout_probs_diff_mean": 0.2, "text": "x"}) == {
        "mismatch_kl_k3": 0.01}


# --- a run judged from log_scalars alone --------------------------------------------------------------

def collapsing_rows(steps: int = 90, collapse: int = 60, seed: int = 0) -> list[dict[str, float]]:
    """A verl-named run: healthy and noisy, then from ``collapse - 15`` the policy KL and the entropy climb,
    the gradient spikes, and from ``collapse`` the score falls."""
    rng = random.Random(seed)
    rows = []
    for s in range(steps):
        drift = max(0, s - (collapse - 15))
        score = min(0.7, 0.2 + 0.01 * s) if s < collapse else max(0.05, 0.7 - 0.05 * (s - collapse))
        rows.append({"actor/ppo_kl": 0.02 * (1 + 0.1 * rng.random()) * (1.25 ** drift),
                     "actor/entropy": 0.6 * (1 + 0.05 * rng.random()) * (1.06 ** drift),
                     "actor/grad_norm": 0.3 * (1 + 0.1 * rng.random()) * (8 if drift > 5 and s % 2 else 1),
                     "critic/score/mean": score + 0.01 * rng.random(),
                     "response_length/mean": 200 + 5 * rng.random(), "timing_s/step": 1.0})
    return rows


def healthy_rows(steps: int = 120, seed: int = 1) -> list[dict[str, float]]:
    rng = random.Random(seed)
    return [{"actor/ppo_kl": 0.004 * (1 + 0.3 * rng.random()), "actor/entropy": 0.6 * (1 + 0.1 * rng.random()),
             "actor/grad_norm": 0.3 * (1 + 0.5 * rng.random()), "response_length/mean": 200 + 20 * rng.random(),
             "response_length/clip_ratio": 0.02 * rng.random(),
             "critic/score/mean": min(0.7, 0.2 + 0.005 * s) + 0.03 * rng.random()} for s in range(steps)]


def replay(rows: list[dict[str, float]], path: str, run: str = "replayed") -> rlwatch.Watch:
    watch = rlwatch.Watch(run=run, port=None, store=path, background=False, strict=True)
    for step, row in enumerate(rows):
        watch.log_scalars(step, row)
    assert watch.flush()
    return watch


def test_a_collapse_logged_only_through_log_scalars_is_stored_exported_and_paged(tmp_path):
    rows = collapsing_rows()
    watch = replay(rows, str(tmp_path / "run.db"))
    text = generate_latest(watch.services.registry).decode()
    assert 'rlwatch_policy_kl{run="replayed"' in text and 'rlwatch_grad_norm{run="replayed"' in text
    watch.close()
    with StoreReader(str(tmp_path / "run.db")) as reader:
        assert [s for s, _ in reader.series("replayed", "reward_mean")] == list(range(len(rows)))
        assert reader.series("replayed", "policy_kl")[0][1] == pytest.approx(rows[0]["actor/ppo_kl"])
        events = reader.alerts("replayed")
    fired = {e["name"]: e["step"] for e in events if e["state"] == "firing"}
    assert {"RLWatchPolicyKLDeparture", "RLWatchEntropySurge", "RLWatchCollapsePrecursors"} <= set(fired)
    assert fired["RLWatchCollapsePrecursors"] < 60          # paged before the score fell
    assert "RLWatchRewardSlide" in fired and fired["RLWatchRewardSlide"] > 60


def test_the_postmortem_dates_the_collapse_on_the_logged_heldout_score(tmp_path):
    from rlwatch.postmortem import analyse, load

    rows = collapsing_rows()
    for step, row in enumerate(rows):          # a held-out score every 5 steps, falling with the training score
        if step % 5 == 0:
            row["val-core/math/acc/mean@4"] = row["critic/score/mean"] - 0.05
    replay(rows, str(tmp_path / "run.db")).close()
    report = analyse(load(str(tmp_path / "run.db")))
    assert report.quality_signal == "heldout_score"
    assert 60 <= report.collapse_step <= 70
    assert report.first_critical is not None and report.first_critical["step"] < report.collapse_step


def test_a_heldout_score_too_sparse_to_date_a_collapse_is_said_so(tmp_path):
    from rlwatch.postmortem import analyse, load

    rows = collapsing_rows()
    for step, row in enumerate(rows):          # a held-out score every 20 steps: 5 evaluations
        if step % 20 == 0:
            row["val-core/math/acc/mean@4"] = row["critic/score/mean"] - 0.05
    replay(rows, str(tmp_path / "run.db")).close()
    report = analyse(load(str(tmp_path / "run.db")))
    assert report.quality_signal == "reward_mean"
    assert any("held-out score was logged 5 times, fewer than the 11" in n for n in report.coverage.notes), \
        report.coverage.notes


def test_a_healthy_logged_run_raises_nothing(tmp_path):
    watch = replay(healthy_rows(), str(tmp_path / "run.db"), run="healthy")
    watch.close()
    with StoreReader(str(tmp_path / "run.db")) as reader:
        assert reader.alerts("healthy") == []


# --- the join with observe -------------------------------------------------------------------------

def fields(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 6, generator=gen)
    return dict(sampler_logp=logp, trainer_logp=logp + 0.01 * torch.randn(4, 6, generator=gen),
                mask=torch.ones(4, 6), entropy=torch.rand(4, 6, generator=gen), rewards=torch.rand(4, generator=gen))


@pytest.mark.parametrize("order", ["observe_first", "scalars_first"])
def test_observe_and_the_trainers_scalars_for_one_step_are_one_verdict(tmp_path, order):
    path = str(tmp_path / "run.db")
    watch = rlwatch.Watch(run="joined", port=None, store=path, background=False, strict=True)
    windows = watch.services.windows
    for step in range(1, 31):
        calls = [lambda: watch.observe(step, **fields(step)),
                 lambda: watch.log_scalars(step, {"grad_norm": 0.5, "entropy": 99.0, "kl": 0.01})]
        for call in calls if order == "observe_first" else calls[::-1]:
            call()
    assert [s for s, _ in windows._steps] == list(range(1, 31))     # each step judged once
    assert watch.flush()
    text = generate_latest(watch.services.registry).decode()
    assert 'rlwatch_grad_norm{run="joined"' in text and 'rlwatch_mismatch_kl_k3{run="joined"' in text
    counted = {k: v for k, v in watch.state.snapshot().counters.get("steps_total", {}).items()}
    watch.close()
    assert counted == {(): 30.0}                                    # the observed steps' counters, once
    with StoreReader(path) as reader:
        rows = {row.step: row for row in reader.steps("joined")}
        raised = {a["name"] for a in reader.alerts("joined")}
    assert not raised & {a.name for a in dynamics.ALERTS}           # noise is no precursor
    assert sorted(rows) == list(range(1, 31))
    assert rows[30].get("grad_norm") == 0.5 and rows[30].get("ref_kl") == 0.01
    assert rows[30].get("mismatch_kl_k3") is not None
    assert rows[30].get("entropy_mean") != 99.0                    # rlwatch's own value wins
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM step_history").fetchone() == (0,)   # no conflict


def test_an_older_steps_log_is_kept_as_scalars_and_not_judged(tmp_path):
    watch = rlwatch.Watch(run="late", port=None, store=str(tmp_path / "run.db"), background=False, strict=True)
    watch.log_scalars(5, {"grad_norm": 1.0})
    watch.log_scalars(3, {"grad_norm": 2.0, "my_metric": 1.0})
    assert [s for s, _ in watch.services.windows._steps] == [5]
    watch.close()
    with StoreReader(str(tmp_path / "run.db")) as reader:
        assert reader.scalars("late")["grad_norm"] == [(3, 2.0), (5, 1.0)]


def test_background_log_scalars_follow_the_queued_steps(tmp_path):
    watch = rlwatch.Watch(run="bg", port=None, store=str(tmp_path / "run.db"), background=True)
    for step in range(1, 6):
        watch.observe(step, **fields(step))
        watch.log_scalars(step, {"actor/grad_norm": float(step)})
    assert watch.flush()
    assert [s for s, _ in watch.services.windows._steps] == [1, 2, 3, 4, 5]
    watch.close()
    with StoreReader(str(tmp_path / "run.db")) as reader:
        assert reader.series("bg", "grad_norm") == [(s, float(s)) for s in range(1, 6)]


# --- the precursor conditions ------------------------------------------------------------------------

def judge(series: dict[str, list[float]], alerts=dynamics.ALERTS) -> dict[str, int]:
    """{alert: first step it opened} over per-step values."""
    windows, opened = AlertWindows(alerts=alerts), {}
    steps = max(len(v) for v in series.values())
    for step in range(steps):
        values = {name: {(): v[step]} for name, v in series.items() if step < len(v) and v[step] is not None}
        out = windows.on_step(step, values)
        for labels in out["alert_incident"]:
            opened.setdefault(labels[0], step)
    return opened


def test_no_condition_raises_without_its_baseline():
    assert judge({"policy_kl": [0.001] * 5 + [1.0] * 10, "entropy_mean": [0.1] * 5 + [5.0] * 10,
                  "grad_norm": [0.1] * 5 + [50.0] * 10}) == {}


def test_a_single_precursor_warns_and_two_together_page():
    base = [0.02, 0.025] * 20
    assert judge({"policy_kl": base + [0.25] * 10}) == {"RLWatchPolicyKLDeparture": 44}
    both = judge({"policy_kl": base + [0.25] * 10, "grad_norm": [0.5, 0.6] * 20 + [5.0] * 10})
    assert both["RLWatchCollapsePrecursors"] <= both["RLWatchPolicyKLDeparture"]


def test_a_slow_rise_follows_the_baseline():
    # a warm-up: the policy KL grows 15x over 150 steps; the trailing baseline follows it
    kl = [0.002 * 15 ** min(1.0, s / 150) for s in range(250)]
    length = [200 * 2 ** min(1.0, s / 150) for s in range(250)]
    assert judge({"policy_kl": kl, "response_length_mean": length}) == {}


def test_grad_norm_dead_pages_after_three_steps_and_clears():
    flags = [0.0] * 10 + [1.0] * 5 + [0.0] * 30
    opened = judge({"grad_norm_nonfinite": flags})
    assert opened == {"RLWatchGradNormDead": 12}
    windows = AlertWindows(alerts=dynamics.ALERTS)
    for step, flag in enumerate(flags):
        out = windows.on_step(step, {"grad_norm_nonfinite": {(): flag}})
    assert not [k for k in out["alert_incident"] if k[-1] == "open"]


def test_reward_slide_reads_the_heldout_score_when_logged():
    rising = [0.1 + 0.01 * s for s in range(40)]
    opened = judge({"reward_mean": rising + [0.5] * 20, "heldout_score": rising + [0.1] * 20})
    assert 40 < opened["RLWatchRewardSlide"] <= 46          # a 10-step median past the bound, 3 steps running
    assert judge({"reward_mean": rising + [0.5] * 20}) == {}                   # the training reward holds


def test_a_flat_noisy_reward_never_slides():
    rng = random.Random(3)
    assert judge({"reward_mean": [0.6 + 0.08 * rng.gauss(0, 1) for _ in range(600)]}) == {}


def test_the_docs_table_lists_every_recognised_name():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "trainer-dynamics.md").read_text()
    for entry in TRAINER_KEYS:
        assert f"`{entry.key or entry.pattern}`" in text, entry
        assert f"`{BY_NAME[entry.signal].full_name}`" in text


# --- RLWatchKLDeparture and a learning-rate warm-up -----------------------------------------------------

def warmup_series(collapse_at: int | None = None, steps: int = 400) -> dict[str, list[float]]:
    """k3 rising 15x with a 100-step linear warm-up (the update size squared), then steady; from
    ``collapse_at`` k3 climbs 8% a step."""
    rng = random.Random(5)
    lr = [1e-6 * (1 / 15 ** 0.5 + (1 - 1 / 15 ** 0.5) * min(1.0, s / 100)) for s in range(steps)]
    k3 = [2e-4 * (lr[s] / lr[0]) ** 2 * (1.08 ** max(0, s - collapse_at) if collapse_at else 1.0)
          * (1 + 0.1 * rng.gauss(0, 1)) for s in range(steps)]
    return {"mismatch_kl_k3": [min(k, 0.09) for k in k3], "learning_rate": lr}


def test_a_warm_up_is_no_kl_departure_when_the_learning_rate_is_logged():
    from rlwatch.alerts.domains.mismatch import KL_DEPARTURE

    series = warmup_series()
    assert judge(series, alerts=[KL_DEPARTURE]) == {}
    assert "RLWatchKLDeparture" in judge({"mismatch_kl_k3": series["mismatch_kl_k3"]}, alerts=[KL_DEPARTURE])
    # after the warm-up, a departure from the steady level still pages
    assert 200 < judge(warmup_series(collapse_at=200), alerts=[KL_DEPARTURE])["RLWatchKLDeparture"] < 240


def test_an_alert_opened_on_the_first_source_fires_once_when_the_step_is_judged_again(tmp_path):
    path = str(tmp_path / "run.db")
    watch = rlwatch.Watch(run="once", port=None, store=path, background=False, strict=True)
    for step in range(1, 8):
        watch.log_scalars(step, {"grad_norm": 0.0})       # judged alone: the dead gradient opens at step 3
        watch.observe(step, **fields(step))                # then judged again with observe's values
    watch.close()
    with StoreReader(path) as reader:
        events = [(a["name"], a["state"], a["step"]) for a in reader.alerts("once")]
    assert events.count(("RLWatchGradNormDead", "firing", 3)) == 1
    assert [e for e in events if e[0] == "RLWatchGradNormDead"] == [("RLWatchGradNormDead", "firing", 3)]


def test_a_trainer_logging_every_ten_steps_is_judged_row_by_row():
    rows = [0.02, 0.025] * 20 + [0.25] * 10                       # the policy KL of 50 logged rows
    sparse = [v if step % 10 == 0 else None for step in range(500) for v in [rows[step // 10]]]
    assert judge({"policy_kl": sparse}, alerts=dynamics.ALERTS) == {"RLWatchPolicyKLDeparture": 440}
    assert judge({"policy_kl": [v if s % 10 == 0 else None for s, v in enumerate([0.02] * 500)]}) == {}


def test_two_precursors_on_nearby_rows_of_a_sparse_log_page():
    """precursor_steps counts logged rows, as the precursors do: the policy KL departs on rows 42-45 and the
    gradient spikes on rows 47-48 of a log written every 10 steps, two rows apart (20 steps)."""
    kl = [0.02, 0.025] * 20 + [0.25] * 4 + [0.02, 0.025] * 3
    grad = [0.5, 0.6] * 23 + [0.5, 5.0, 5.0, 0.5]
    every_tenth = {name: [v if step % 10 == 0 else None for step in range(500) for v in [rows[step // 10]]]
                   for name, rows in (("policy_kl", kl), ("grad_norm", grad))}
    fired = judge(every_tenth)
    assert fired["RLWatchCollapsePrecursors"] == 470, fired
    every_step = judge({"policy_kl": kl, "grad_norm": grad})
    assert every_step["RLWatchCollapsePrecursors"] == 47, every_step


def test_a_run_of_twenty_logged_rows_is_judged():
    kl = [0.02, 0.025] * 6 + [0.25] * 8                     # 20 rows: a departure from the 13th
    assert judge({"policy_kl": kl}) == {"RLWatchPolicyKLDeparture": 16}
    assert judge({"policy_kl": [0.02, 0.025] * 10}) == {}


# --- runs of a few prompts a step: noise the baseline already holds, steps without a learning signal ----------

def one_prompt_a_step(steps: int = 120, seed: int = 7) -> dict[str, list[float]]:
    """A run of one prompt a step: on most steps the group's rewards are all equal (the zero-std ratio at 1,
    the gradient ~0, the entropy of a settled prompt); on the others the gradient and entropy jump."""
    rng = random.Random(seed)
    live = [rng.random() < 0.35 for _ in range(steps)]
    return {"zero_std_ratio": [0.0 if on else 1.0 for on in live],
            "grad_norm": [10.0 if on else 1e-8 for on in live],
            "entropy_mean": [0.3 * (1 + rng.random()) if on else 0.002 for on in live]}


def test_a_signal_that_already_swung_that_high_in_its_baseline_is_not_rising():
    series = one_prompt_a_step()
    grad = series["grad_norm"]
    assert judge({"grad_norm": grad}) == {}            # no zero-std ratio logged: the baseline's noise guards
    opened = judge({"grad_norm": grad[:100] + [200.0, 1e-8, 200.0, 1e-8] + grad[104:]})
    assert opened.get("RLWatchGradNormSpike") == 102    # a spike far above what the baseline held still raises
    for p in ("dynamics_noise_quantile",):
        assert p in dynamics.GRAD_SPIKE.params and p in dynamics.ENTROPY_SURGE.params


def test_steps_without_a_learning_signal_are_left_out_of_the_precursors():
    series = one_prompt_a_step(seed=11)
    # three live steps in a row lift the 5-step median of the entropy far above its mostly-settled baseline
    entropy = series["entropy_mean"][:80] + [0.002, 0.5, 0.55, 0.6] + series["entropy_mean"][84:]
    zero_std = series["zero_std_ratio"][:80] + [1.0, 0.0, 0.0, 0.0] + series["zero_std_ratio"][84:]
    assert "RLWatchEntropySurge" in judge({"entropy_mean": entropy})
    assert judge({"entropy_mean": entropy, "zero_std_ratio": zero_std}) == {}
    # a zero gradient on a step whose groups all had equal rewards is the data's, not a dead trainer
    dead = {"grad_norm_zero": [0.0] * 20 + [1.0] * 5, "zero_std_ratio": [0.2] * 20 + [1.0] * 5}
    assert judge(dead) == {}
    assert judge({**dead, "zero_std_ratio": [0.2] * 25}) == {"RLWatchGradNormDead": 22}
    assert recognise({"frac_reward_zero_std": 1.0}) == {"zero_std_ratio": 1.0}     # TRL's name


def judge_labelled(series: dict[str, dict[tuple[str, ...], list[float | None]]]) -> dict[str, int]:
    """{alert: first step it opened} over per-step values of labelled series (None: not logged that step)."""
    windows, opened = AlertWindows(alerts=dynamics.ALERTS), {}
    steps = max(len(v) for family in series.values() for v in family.values())
    for step in range(steps):
        values = {name: {labels: v[step] for labels, v in family.items() if v[step] is not None}
                  for name, family in series.items()}
        for labels in windows.on_step(step, {k: v for k, v in values.items() if v})["alert_incident"]:
            opened.setdefault(labels[0], step)
    return opened


def test_steps_whose_groups_all_passed_or_failed_in_observe_have_no_learning_signal():
    # the same condition as a logged zero-std ratio at 1, from rlwatch's own count of observe's groups
    series = one_prompt_a_step(seed=11)
    entropy = series["entropy_mean"][:80] + [0.002, 0.5, 0.55, 0.6] + series["entropy_mean"][84:]
    settled = [1.0 - live for live in series["zero_std_ratio"][:80] + [1.0, 0.0, 0.0, 0.0] +
               series["zero_std_ratio"][84:]]
    all_pass = [0.5 * (1.0 - s) for s in settled]                 # the settled steps: half all pass, half all fail
    groups = {("all_pass",): all_pass, ("all_fail",): [1.0 - s - p for s, p in zip(settled, all_pass)]}
    assert "RLWatchEntropySurge" in judge_labelled({"entropy_mean": {(): entropy}})
    assert judge_labelled({"entropy_mean": {(): entropy}, "zero_variance_groups_ratio": groups}) == {}
    dead = [0.0] * 20 + [1.0] * 5
    constant = {("all_pass",): [0.1] * 20 + [0.7] * 5, ("all_fail",): [0.1] * 20 + [0.3] * 5}
    assert judge_labelled({"grad_norm_zero": {(): dead}, "zero_variance_groups_ratio": constant}) == {}
    live = {("all_pass",): [0.1] * 25, ("all_fail",): [0.1] * 25}
    assert judge_labelled({"grad_norm_zero": {(): dead}, "zero_variance_groups_ratio": live}) == \
        {"RLWatchGradNormDead": 22}


def test_a_zero_gradient_on_a_row_of_several_steps_some_without_a_learning_signal_is_not_dead():
    # TRL logs every 10 steps: the zero-std ratio is the mean over the 10, the gradient norm the last step's
    every_ten = [s % 10 == 0 for s in range(300)]
    dead = [(1.0 if s >= 200 else 0.0) if on else None for s, on in enumerate(every_ten)]
    for share, opens in ((0.6, None), (0.0, 220)):
        zero_std = [share if on else None for on in every_ten]
        assert judge_labelled({"grad_norm_zero": {(): dead}, "zero_std_ratio": {(): zero_std}}).get(
            "RLWatchGradNormDead") == opens
    # logged every step, a zero gradient while some groups had rewards to learn from is a dead trainer
    assert judge_labelled({"grad_norm_zero": {(): [0.0] * 20 + [1.0] * 5},
                           "zero_std_ratio": {(): [0.6] * 25}}) == {"RLWatchGradNormDead": 22}
