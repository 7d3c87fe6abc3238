"""rlwatch in a custom RL loop: a tiny real policy trained with GRPO-style updates.

The sampler is a copy of the policy that lags the trainer by ``--lag`` updates (as in an
asynchronous pipeline), so the mismatch and staleness signals are real. Run it and open
http://127.0.0.1:9400/metrics while it trains (or `rlwatch up` first: Prometheus scrapes every 5 s;
each step is paced to --pace seconds, 0.5 by default, so the default 60 steps take about 30 s):

    python examples/custom_loop.py --steps 60 --lag 4
    python examples/custom_loop.py --pace 0 --store none     # as fast as it goes, no run store
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import rlwatch

VOCAB, EOS, PROMPT_LEN, MAX_NEW = 12, 0, 4, 10


class TinyPolicy(torch.nn.Module):
    """Embedding + GRU + head over a 12-token vocabulary; logits [B, T, V]."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(ids))[0])


@torch.no_grad()
def sample(policy: TinyPolicy, prompts: torch.Tensor, gen: torch.Generator):
    """Sample responses; returns ids [B, P+N], response mask [B, N], sampler log-probs [B, N]."""
    ids, logps, alive = prompts, [], torch.ones(len(prompts), dtype=torch.bool)
    masks = []
    for _ in range(MAX_NEW):
        logp = torch.log_softmax(policy(ids)[:, -1], -1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        masks.append(alive.clone())
        logps.append(logp.gather(1, tok).squeeze(1))
        ids = torch.cat([ids, torch.where(alive[:, None], tok, torch.full_like(tok, EOS))], 1)
        alive &= tok.squeeze(1) != EOS
    return ids, torch.stack(masks, 1), torch.stack(logps, 1)


def token_logp(policy: TinyPolicy, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each response token under ``policy``: [B, N]."""
    logits = policy(ids[:, :-1])[:, PROMPT_LEN - 1:]
    return torch.log_softmax(logits, -1).gather(2, ids[:, PROMPT_LEN:, None]).squeeze(2)


def reward(prompts: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 when the response has exactly (prompt[0] mod 4) + 1 tokens before EOS, else 0."""
    ended = (ids[:, PROMPT_LEN:] == EOS) & mask
    length = mask.sum(1) - ended.any(1).long()
    return ((length == prompts[:, 0] % 4 + 1) & ended.any(1)).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--lag", type=int, default=2, help="sampler staleness in updates (default 2)")
    parser.add_argument("--pace", type=float, default=0.5,
                        help="minimum seconds per step, so that scrapes see the run (default 0.5; 0: no pacing)")
    parser.add_argument("--port", type=int, default=9400,
                        help="metrics port, the next free one if taken (default 9400)")
    parser.add_argument("--run", default="custom-loop", help="run name (default custom-loop)")
    parser.add_argument("--store", default="auto",
                        help="run-store path; auto: rlwatch-runs/<run>.db; none: no store (default auto)")
    args = parser.parse_args()
    store = None if args.store.lower() in ("none", "off") else args.store

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    policy = TinyPolicy()
    optim = torch.optim.Adam(policy.parameters(), lr=3e-3)
    versions = [copy.deepcopy(policy.state_dict())]
    sampler = copy.deepcopy(policy)
    groups, group_size = 16, 8

    with rlwatch.Watch(run=args.run, port=args.port, port_fallback=True, store=store,
                       staleness_bound=2, group_size=group_size) as watch:
        print(f"serving {watch.url}; run store {watch.store_path or 'none'}; "
              f"{args.steps} steps, at least {args.pace:g} s each")
        for step in range(args.steps):
            started = time.monotonic()
            sampler.load_state_dict(versions[0])                     # the oldest kept version samples
            sampler_version = step - (len(versions) - 1)
            prompts = torch.randint(1, VOCAB, (groups, PROMPT_LEN), generator=gen).repeat_interleave(group_size, 0)
            ids, mask, sampler_logp = sample(sampler, prompts, gen)
            with torch.no_grad():
                old_logp = token_logp(policy, ids)
            rewards = reward(prompts, ids, mask)
            grouped = rewards.view(groups, group_size)
            adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
            watch.observe(step, mask=mask, sampler_logp=sampler_logp, trainer_logp=old_logp,
                          seq_version=torch.full((len(ids),), sampler_version), trainer_version=step,
                          rewards=rewards, group_ids=torch.arange(len(ids)) // group_size,
                          truncated=mask.all(1), env=["repeat" if i % 2 else "repeat-long" for i in range(len(ids))])
            ratio = (token_logp(policy, ids) - old_logp).exp()
            clipped = torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
            loss = -(clipped * mask).sum() / mask.sum()
            optim.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optim.step()
            watch.log_scalars(step, {"loss": loss, "grad_norm": grad_norm, "reward": rewards.mean()})
            versions = (versions + [copy.deepcopy(policy.state_dict())])[-(args.lag + 1):]
            if step % 10 == 0:
                print(f"step {step:3d} reward {rewards.mean():.2f} loss {loss.item():+.3f}")
            time.sleep(max(0.0, args.pace - (time.monotonic() - started)))
        time.sleep(0.1)
    if watch.store_path:
        print(f"done: every step is in {watch.store_path} (rlwatch postmortem {watch.store_path})")


if __name__ == "__main__":
    main()
