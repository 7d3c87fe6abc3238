"""One process of the two-process TRL test (``tests/test_trl_multiprocess.py``).

    python -m tests._trl_multiprocess MODEL_DIR OUTPUT_DIR RESULT_JSON

The test starts one per rank with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``): accelerate then runs TRL's
``GRPOTrainer`` on CPU with the gloo backend. Every rank calls ``rlwatch.integrations.trl.watch``
as a user's script would (with ``all_ranks=True`` when ``TEST_ALL_RANKS=1``). Each rank records,
independently of rlwatch, what its reward functions were called on (the checker of an ``audited``
reward sees every completion this rank scored, with its ids and environment); an exporting rank
also records the episodes handed to the hack detectors, what its ``/metrics`` serves at the end
and the verdict counts not yet exported. The result is one JSON file per rank.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from typing import Any

from tests._trl_tiny import EOS, PAD, reward_has_w1

CALLS: list[list[dict[str, Any]]] = []      # one list per reward call (per generation batch) on this rank


def reward_full_length(completion_ids: list, **kwargs: Any) -> list[float]:
    """1 for a completion that hit the length limit (8 tokens, no EOS), else 0: coarse, so that some
    groups of the tiny random model's completions have equal rewards and others do not."""
    return [1.0 if len(ids) == 8 and ids[-1] not in (EOS, PAD) else 0.0 for ids in completion_ids]


def check(prompts: list, completions: list, completion_ids: list, environment: list, **kwargs: Any) -> list[bool]:
    """The independent checker: records what this rank scored; its verdict is "an even number of tokens"."""
    CALLS.append([dict(prompt=p, completion=c, ids=[int(i) for i in ids], env=e)
                  for p, c, ids, e in zip(prompts, completions, completion_ids, environment)])
    return [len(ids) % 2 == 0 for ids in completion_ids]


def main(model_path: str, output_dir: str, result_path: str) -> None:
    from rlwatch.integrations import trl as rltrl

    from tests._trl_tiny import make_trainer

    funcs = [reward_full_length, rltrl.audited(reward_has_w1, check)]
    trainer = make_trainer(model_path, output_dir, reward_funcs=funcs, per_device_train_batch_size=3,
                           num_generations=4, steps_per_generation=2, max_steps=4)
    watch = rltrl.watch(trainer, run="trl-2proc", port=0, all_ranks=os.environ.get("TEST_ALL_RANKS") == "1")
    submitted: list[dict[str, Any]] = []
    if watch.active:
        submit = watch.submit_episodes

        def tap(step: int, episodes: Any, env: Any = None) -> None:
            submitted.append(dict(step=step, episodes=[
                dict(prompt=e["prompt"], completion=e["response"], env=e["env"], reward=e["reward"],
                     true_pass=e["extra"].get("true_pass"), truncated=e["truncated"]) for e in episodes]))
            submit(step, episodes, env=env)

        watch.submit_episodes = tap
    trainer.train()
    metrics, leftover = None, None
    if watch.active:
        watch.flush()
        if watch.hacks is not None:
            assert watch.hacks.flush(60), "the hack detectors did not finish"
            counts = watch.hacks.collect() or {}
            leftover = [[list(labels), n] for labels, n in counts.get("episodes_judged_total", {}).items()]
        with urllib.request.urlopen(watch.url, timeout=10) as resp:
            metrics = resp.read().decode()
    result = dict(rank=int(os.environ["RANK"]), process_index=trainer.accelerator.process_index,
                  num_processes=trainer.accelerator.num_processes, active=watch.active, url=watch.url,
                  store=watch.store_path, run=watch.run, global_step=trainer.state.global_step,
                  errors={"/".join(k): v for k, v in watch.errors.snapshot().items()},
                  log_history=trainer.state.log_history, calls=CALLS, submitted=submitted, metrics=metrics,
                  judged_not_exported=leftover)
    rltrl.unwatch(trainer)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
