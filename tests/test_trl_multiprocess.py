"""TRL in two processes for real: ``GRPOTrainer`` on CPU with accelerate's gloo backend (two Python
processes started with torchrun's environment on 127.0.0.1, each running ``tests._trl_multiprocess``).

Each process trains on its own share of every generation batch; TRL gathers the rewards over
processes, and so must rlwatch (truncation, lengths, environments, and the hack detectors'
episodes). Checked against what TRL logs for the same gathered batches and against what each
process's reward functions were independently called on:

- by default rank 0 exports (its /metrics and the run store), rank 1 exports and stores nothing;
  with ``all_ranks=True`` each rank exports its own run (``<run>-rank<N>``): its own micro-batches'
  token-level signals, and the same episode-level values of the whole gathered batches;
- the zero-variance fraction, truncation and per-function reward means equal TRL's
  ``frac_reward_zero_std``, ``completions/clipped_ratio`` and ``rewards/<fn>/mean``, and the batch
  rebuilt from both processes' rows;
- the hack detectors judge every process's episodes once (``episodes_judged_total`` per
  environment counts both processes' rows), with each process's checker verdicts.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rlwatch.integrations.trl import GENERATION_FAMILIES
from rlwatch.runs.store import StoreReader

from tests.conftest import ROOT, free_port, need_module

need_module("trl")

from tests._trl_multiprocess import reward_full_length  # noqa: E402
from tests._trl_tiny import EOS, PAD, build_tiny_model, reward_has_w1  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]
WORLD = 2
TIMEOUT_S = 240
FUNCS = {"reward_full_length": reward_full_length, "reward_has_w1": reward_has_w1}
G = 4                                    # num_generations in tests/_trl_multiprocess.py


def run_ranks(tmp_path, all_ranks: bool = False) -> list[dict]:
    """Start both ranks, wait (at most TIMEOUT_S), stop any still running by PID; their results."""
    model = build_tiny_model(tmp_path / "model")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD),
               GLOO_SOCKET_IFNAME="lo",                  # gloo's pairs on loopback too, not the hostname's address
               LOCAL_WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TEST_ALL_RANKS="1" if all_ranks else "0")
    procs = []
    try:
        for rank in range(WORLD):
            log = open(tmp_path / f"rank{rank}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests._trl_multiprocess", model, str(tmp_path / "out"),
                 str(tmp_path / f"rank{rank}.json")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
            log.close()
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    logs = [(tmp_path / f"rank{rank}.log").read_text(errors="replace")[-3000:] for rank in range(WORLD)]
    assert [p.returncode for p in procs] == [0] * WORLD, logs
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def gathered_batches(results: list[dict]) -> list[dict]:
    """Each generation batch as TRL gathers it (rank 0's rows, then rank 1's), rebuilt from what the
    reward functions were called on: rewards per function (None -> NaN), truncation, groups."""
    counts = {len(r["calls"]) for r in results}
    assert len(counts) == 1
    batches = []
    for k in range(counts.pop()):
        rows = [row for r in results for row in r["calls"][k]]
        texts, envs, ids = [r["completion"] for r in rows], [r["env"] for r in rows], [r["ids"] for r in rows]
        per_func = torch.tensor([[math.nan if v is None else v
                                  for v in f(completions=texts, completion_ids=ids, environment=envs)]
                                 for f in FUNCS.values()], dtype=torch.float64).T
        total = per_func.nansum(1)
        total[torch.isnan(per_func).all(1)] = math.nan
        scorable = ~torch.isnan(total)
        zero = 0
        for g in range(len(rows) // G):                           # consecutive groups of the gathered order
            r = total[g * G:(g + 1) * G]
            if bool(scorable[g * G:(g + 1) * G].all()) and bool((r == r[0]).all()):
                zero += G
        batches.append(dict(rows=rows, per_func=per_func, total=total, zero_fraction=zero / len(rows),
                            truncated=sum(i[-1] not in (EOS, PAD) for i in ids) / len(rows),
                            envs=envs, verdicts=[len(i) % 2 == 0 for i in ids]))
    return batches


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Samples keyed by name and labels, run_instance left out: one process per run in these tests."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run_instance"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("all_ranks", [False, True], ids=["rank0-exports", "all-ranks-export"])
def test_two_processes_gather_like_trl(tmp_path, all_ranks):
    results = run_ranks(tmp_path, all_ranks)
    assert [(r["process_index"], r["num_processes"], r["global_step"]) for r in results] == [(0, 2, 4), (1, 2, 4)]
    assert [r["errors"] for r in results] == [{}, {}]
    store = str(tmp_path / "out" / "rlwatch.db")
    if all_ranks:                 # every rank exports its own run, on its own port, into the run store
        exporters = results
        assert [r["run"] for r in results] == ["trl-2proc-rank0", "trl-2proc-rank1"]
        assert all(r["active"] and r["store"] == store for r in results) and results[0]["url"] != results[1]["url"]
    else:                         # only rank 0 exports and stores anything
        exporters = results[:1]
        lead, other = results
        assert lead["active"] and lead["url"] and lead["store"] == store and lead["run"] == "trl-2proc"
        assert not other["active"] and other["url"] is None and other["store"] is None
        assert other["submitted"] == [] and other["metrics"] is None
    batches = gathered_batches(results)
    # Generation batches scored at steps 1 and 3 (steps_per_generation=2): 2 ranks x 6 rows, groups of 4
    # (the middle group spans both processes).
    assert len(batches) == 2 and all(len(b["rows"]) == 12 for b in batches)
    with StoreReader(store) as reader:
        assert sorted(reader.runs()) == sorted(r["run"] for r in exporters)
        stored = [({row.step: row for row in reader.steps(r["run"])},
                   {name: dict(points) for name, points in reader.scalars(r["run"]).items()}) for r in exporters]
    for result, (rows, scalars) in zip(exporters, stored):
        check_exporter(result, rows, scalars, batches)
    if all_ranks:                 # the same whole batches on both ranks; each rank's own micro-batches
        (rows0, _), (rows1, _) = stored
        for step in rows0:
            for name in GENERATION_FAMILIES:
                assert rows0[step].values.get(name) == rows1[step].values.get(name), (step, name)
        assert any(rows0[s].get("tokens") != rows1[s].get("tokens") for s in rows0)


def check_exporter(result: dict, rows: dict, scalars: dict, batches: list[dict]) -> None:
    """One exporting rank's run store and /metrics against TRL's logs and both processes' rows."""
    run = result["run"]
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(row.get("sequences") == 3 for row in rows.values())     # its own micro-batch (3 rows)
    logs = {h["step"]: h for h in result["log_history"] if "loss" in h}
    for step, batch in zip((1, 3), batches):
        row, log = rows[step], logs[step]
        n = len(batch["rows"])
        scorable = int((~torch.isnan(batch["total"])).sum())
        assert sum(row.values["episodes_total"].values()) == n     # every process's rows, once
        assert row.values["env_episodes"] == {(e,): float(batch["envs"].count(e)) for e in set(batch["envs"])}
        assert row.get("groups") == n // G
        # Zero-variance groups: TRL's frac_reward_zero_std, and the groups rebuilt from both processes.
        assert row.get("zero_gradient_episodes_ratio") * scorable / n == pytest.approx(
            log["frac_reward_zero_std"], abs=1e-7)    # TRL: float32
        assert row.get("zero_gradient_episodes_ratio") * scorable / n == pytest.approx(batch["zero_fraction"])
        # Truncation: TRL's completions/clipped_ratio, and the ids both processes scored.
        assert row.get("truncated_ratio") == pytest.approx(log["completions/clipped_ratio"], abs=1e-7)
        assert row.get("truncated_ratio") == pytest.approx(batch["truncated"])
        # Rewards: TRL's rewards/<fn>/mean (None excluded) and reward.
        for j, name in enumerate(FUNCS):
            column = batch["per_func"][:, j]
            assert scalars[f"rlwatch/rewards/{name}/mean"][step] == pytest.approx(log[f"rewards/{name}/mean"], rel=1e-6)
            assert scalars[f"rlwatch/rewards/{name}/mean"][step] == pytest.approx(float(column.nanmean()))
        assert row.get("reward_mean") == pytest.approx(log["reward"], rel=1e-6)
        assert rows[step + 1].get("generation") == row.get("generation") == batches.index(batch) + 1
    # Not a trivial agreement: some groups carry no gradient, some do; some completions are cut off.
    assert 0 < max(b["zero_fraction"] for b in batches) and min(b["zero_fraction"] for b in batches) < 1
    assert all(0 < b["truncated"] < 1 for b in batches)

    # The hack detectors got every process's episodes, once, in TRL's order, with each process's verdicts.
    assert [s["step"] for s in result["submitted"]] == [0, 2]
    for submitted, batch in zip(result["submitted"], batches):
        got = [(e["prompt"], e["completion"], e["env"], e["true_pass"]) for e in submitted["episodes"]]
        assert got == [(r["prompt"], r["completion"], r["env"], v) for r, v in zip(batch["rows"], batch["verdicts"])]
        assert [e["reward"] for e in submitted["episodes"]] == pytest.approx(batch["total"].nan_to_num(0.0).tolist())
    # ... and judged them: per environment and detector, every episode of both processes.
    metrics = metric_samples(result["metrics"])
    judged = {(labels["env"], labels["detector"]): v for (name, key), v in metrics.items()
              for labels in [dict(key)] if name == "rlwatch_episodes_judged_total"}
    for (env, detector), n in result["judged_not_exported"]:
        judged[(env, detector)] = judged.get((env, detector), 0.0) + n
    envs = [e for b in batches for e in b["envs"]]
    for detector in ("degenerate_output", "verifier_disagreement"):
        assert {env: judged.get((env, detector)) for env in set(envs)} == {env: envs.count(env) for env in set(envs)}
    # /metrics: both batches, all 24 episodes.
    assert metrics[("rlwatch_generation", (("run", run),))] == 2
    assert sum(v for (name, _), v in metrics.items() if name == "rlwatch_episodes_total") == 24
