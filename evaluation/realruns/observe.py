"""Feed a corpus run as a custom training loop would, instead of replaying its log: each logged row's
entropy, reward, clipped ratio and zero-std share become :meth:`rlwatch.Watch.observe` fields with the
same aggregates, and every other logged scalar goes through :meth:`rlwatch.Watch.log_scalars` at the same
step.

The fields: :data:`GROUPS` groups of :data:`GROUP_SIZE` responses of :data:`TOKENS` tokens each; every
token's entropy is the logged mean entropy; the rewards average the logged reward, the logged zero-std
share of the groups (rounded to whole groups) having all-equal rewards and the others +-0.5 around it;
the logged clipped ratio of the responses (rounded) flagged truncated; sampler and trainer log-probs
equal (no mismatch is logged by most runs). The response length is not carried: every response is
:data:`TOKENS` tokens, and rlwatch's own value of a signal wins over the trainer's where both give one,
so the length the log carries is not judged on this path (its clipped ratio is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlwatch.replay import AlertEntry, LoggedRun
from rlwatch.alerts.notify import quiet_alert_log
from rlwatch.replay.run import alert_entries, fresh_store

GROUPS, GROUP_SIZE, TOKENS = 8, 8, 16
#: The logged signals carried by observe's fields (the others go through log_scalars).
CARRIED = ("entropy_mean", "reward_mean", "truncated_ratio", "zero_std_ratio")


def step_fields(row: dict[str, float], keys: dict[str, str]) -> dict[str, Any]:
    """``observe`` fields whose aggregates are the row's (``keys``: {signal: logged key})."""
    responses = GROUPS * GROUP_SIZE
    logp = torch.full((responses, TOKENS), -0.5)
    fields: dict[str, Any] = {"sampler_logp": logp, "trainer_logp": logp.clone(), "mask": torch.ones(responses, TOKENS)}
    entropy = row.get(keys.get("entropy_mean", ""))
    if entropy is not None:
        fields["entropy"] = torch.full((responses, TOKENS), float(entropy))
    reward = row.get(keys.get("reward_mean", ""))
    if reward is not None:
        rewards = torch.full((GROUPS, GROUP_SIZE), float(reward))
        constant = round(min(max(row.get(keys.get("zero_std_ratio", ""), 0.0), 0.0), 1.0) * GROUPS)
        rewards[constant:, 0::2] += 0.5
        rewards[constant:, 1::2] -= 0.5
        fields["rewards"] = rewards.reshape(-1)
        fields["group_ids"] = torch.arange(GROUPS).repeat_interleave(GROUP_SIZE)
    truncated = row.get(keys.get("truncated_ratio", ""))
    if truncated is not None:
        flags = torch.zeros(responses, dtype=torch.bool)
        flags[:round(min(max(truncated, 0.0), 1.0) * responses)] = True
        fields["truncated"] = flags
    return fields


def feed(run: LoggedRun, store_dir: str | Path, name: str,
         overrides: dict[str, float] | None = None) -> list[AlertEntry]:
    """Feed ``run`` through ``observe`` + ``log_scalars`` into a fresh store ``<store_dir>/<name>.db``
    (as :func:`rlwatch.replay.replay` does, but for the feed); its alert events in order."""
    from rlwatch.hook.watch import Watch
    from rlwatch.postmortem import load

    store = fresh_store(store_dir, name)
    keys = {signal: key for key, signal in run.recognised().items() if signal in CARRIED}
    carried = set(keys.values()) | {"reward"}         # replay's alias of a reward key is carried too
    with quiet_alert_log():
        watch = Watch(run=name, port=None, store=str(store), alerts=True, sd_dir="", hack_detectors=False,
                      background=False, alert_overrides=dict(overrides or {}), framework="custom")
        try:
            for step, row in zip(run.steps, run.fed_rows()):
                watch.observe(step, **step_fields(row, keys))
                watch.log_scalars(step, {k: v for k, v in row.items() if k not in carried})
        finally:
            watch.close()
    return alert_entries(load(str(store), run=name).alerts)
