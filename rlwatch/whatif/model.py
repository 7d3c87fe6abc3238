"""The episode-duration model of chapter 13 of the Agent RL tutorial (section 13.2) and the figures it derives from a
pool of durations: the straggler ratio of a synchronous batch, the length bias of dropping
failures under a constant hazard (section 13.7).

The model: an agent episode alternates decoding and tool calls. Its number of turns is geometric
(mean ``mean_turns``, clamped to 1 .. ``max_turns``); each turn decodes a uniform number of tokens
in ``tokens_per_turn`` at ``decode_rate`` tokens/s and waits for a tool whose latency is
log-normal (median ``tool_median`` s, log-scale ``tool_sigma``). The defaults are the chapter's:
mean 96 s, median 68 s, p99 430 s. Random draws come from a seeded ``torch.Generator`` in a fixed
order (turns, then decode, then tool latencies), so a seed gives the same pool on every machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DurationModel:
    """Parameters of the agent-episode duration model (seconds, tokens, tokens/s)."""

    mean_turns: float = 8.0
    max_turns: int = 40
    tokens_per_turn: tuple[int, int] = (100, 600)
    decode_rate: float = 40.0
    tool_median: float = 2.0
    tool_sigma: float = 1.0

    def sample(self, n: int, seed: int = 0) -> torch.Tensor:
        """``n`` episode durations [n] in seconds (float32), drawn with ``torch.Generator`` seed ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        first_turn_survival = torch.rand(n, generator=gen)
        # inverse CDF of a geometric number of turns with success probability 1 / mean_turns
        turns = (torch.log1p(-first_turn_survival) / math.log(1 - 1 / self.mean_turns)).ceil()
        turns = turns.clamp(1, self.max_turns)                                               # [n]
        low, high = self.tokens_per_turn
        decode_s = (low + (high - low) * torch.rand(n, self.max_turns, generator=gen)) / self.decode_rate
        tool_s = self.tool_median * torch.exp(self.tool_sigma * torch.randn(n, self.max_turns, generator=gen))
        taken = torch.arange(self.max_turns) < turns[:, None]                                # [n, max_turns]
        return ((decode_s + tool_s) * taken).sum(-1)


#: The chapter's pool: 65,536 episodes of the default model, seed 0.
CHAPTER_POOL_SIZE = 65_536


def chapter_durations() -> torch.Tensor:
    """The chapter's pool of durations [65536] s (the default model, seed 0)."""
    return DurationModel().sample(CHAPTER_POOL_SIZE, seed=0)


@dataclass(frozen=True)
class PoolSummary:
    """Mean, median, p90, p99 and max of a pool of durations (seconds)."""

    mean: float
    median: float
    p90: float
    p99: float
    max: float


def summarise(durations: torch.Tensor) -> PoolSummary:
    """The pool's mean and quantiles [s]."""
    d = durations.double()
    q = torch.quantile(d, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return PoolSummary(d.mean().item(), q[0], q[1], q[2], d.max().item())


def straggler_ratio(durations: torch.Tensor, batch_size: int) -> float:
    """Expected slowest episode of a batch of ``batch_size`` over the mean duration: the pool is cut
    into consecutive batches (a trailing partial batch is left out) and their maxima averaged."""
    usable = len(durations) // batch_size * batch_size
    if usable == 0:
        raise ValueError(f"a pool of {len(durations)} durations holds no batch of {batch_size}")
    batches = durations[:usable].double().view(-1, batch_size)
    return (batches.max(-1).values.mean() / durations.double().mean()).item()


@dataclass(frozen=True)
class FailureBias:
    """What dropping failed episodes does under a constant failure hazard."""

    failing: float              # fraction of all episodes that fail
    failing_longest_tenth: float  # fraction of the longest 10% that fail
    mean_all: float             # mean duration of all episodes [s]
    mean_survivors: float       # mean duration of the episodes that did not fail [s]


def failure_bias(durations: torch.Tensor, seconds_per_failure: float = 2000.0, seed: int = 1) -> FailureBias:
    """Each episode fails with probability 1 - exp(-d / seconds_per_failure) (a constant hazard),
    drawn with ``torch.Generator`` seed ``seed``; the longest tenth is above the pool's p90."""
    draw = torch.rand(len(durations), generator=torch.Generator().manual_seed(seed))
    failed = draw < 1 - torch.exp(-durations / seconds_per_failure)
    longest = durations > durations.quantile(0.9)
    return FailureBias(failed.float().mean().item(), failed[longest].float().mean().item(),
                       durations.double().mean().item(), durations[~failed].double().mean().item())
