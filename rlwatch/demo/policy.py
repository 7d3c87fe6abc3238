"""The demo's policies (a GRU and a small causal transformer) and how the sampler draws from them.

Shapes as in :mod:`rlwatch.demo.scenario`: ``B`` episodes, ``P`` prompt length, ``T`` response positions,
``V`` vocabulary size; log-probs in nats.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .config import ScenarioConfig
from .tasks import EOS, PAD, VOCAB

class Policy(nn.Module):
    """Embedding -> one-layer GRU -> linear head over ``VOCAB`` tokens."""

    def __init__(self, embed_dim: int = 32, hidden_dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed_dim)
        self.gru = nn.GRU(embed_dim, hidden_dim, batch_first=True)
        self.head = nn.Linear(hidden_dim, VOCAB)

    def encode(self, ids: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, L] int64 -> (hidden states [B, L, H], last state [1, B, H])."""
        return self.gru(self.embed(ids), h)

    def response_logits(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of each response token: [B, P], [B, T] -> [B, T, V]."""
        ids = torch.cat([prompts, responses[:, :-1]], dim=1)
        out, _ = self.encode(ids)
        return self.head(out[:, prompts.shape[1] - 1:])


class TransformerPolicy(nn.Module):
    """Embedding + learned positions -> two causal transformer layers -> linear head over ``VOCAB``.

    The same interface as :class:`Policy`: ``encode(ids, state)`` returns the hidden states of the
    new positions and a state, here the whole prefix of ids (sequences are a few tokens long, so
    each call re-encodes the prefix instead of keeping a key-value cache)."""

    MAX_LEN = 32

    def __init__(self, embed_dim: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed_dim)
        self.pos = nn.Embedding(self.MAX_LEN, embed_dim)
        layer = nn.TransformerEncoderLayer(embed_dim, heads, dim_feedforward=2 * embed_dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(embed_dim, VOCAB)

    def encode(self, ids: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, L] int64, h = earlier ids [B, L0] or None -> (hidden states [B, L, E], ids [B, L0 + L])."""
        full = ids if h is None else torch.cat([h, ids], dim=1)
        n = full.shape[1]
        x = self.embed(full) + self.pos(torch.arange(n))[None]
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        out = self.body(x, mask=causal)
        return out[:, n - ids.shape[1]:], full

    def response_logits(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of each response token: [B, P], [B, T] -> [B, T, V]."""
        ids = torch.cat([prompts, responses[:, :-1]], dim=1)
        out, _ = self.encode(ids)
        return self.head(out[:, prompts.shape[1] - 1:])


def make_policy(config: ScenarioConfig) -> nn.Module:
    if config.policy == "transformer":
        return TransformerPolicy(config.embed_dim)
    return Policy(config.embed_dim, config.hidden_dim)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- sampling ---------------------------------------------------------------------------------

def _sampler_logp(logits: torch.Tensor, temperature: float, top_p: float | None) -> torch.Tensor:
    """Log-probs the sampler draws from: logits [B, V] -> [B, V], -inf outside the top-p nucleus."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p is None or top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
    keep_sorted = mass_before < top_p                      # always keeps the top token
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = logp.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def _head(model: nn.Module, hidden: torch.Tensor, precision: str | None) -> torch.Tensor:
    """The sampler's logits [B, V] from hidden states [B, H] at ``precision``: None (float32), "bf16"
    (logits rounded to bfloat16) or "fp8" (output weights rounded to float8 e4m3, one scale per row)."""
    if precision == "fp8":
        weight = model.head.weight
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0     # e4m3's largest finite value
        quantised = (weight / scale).to(torch.float8_e4m3fn).float() * scale
        return torch.nn.functional.linear(hidden, quantised, model.head.bias)
    logits = model.head(hidden)
    return logits.to(torch.bfloat16).float() if precision == "bf16" else logits


@torch.no_grad()
def sample(new: Policy, prompts: torch.Tensor, max_len: int, gen: torch.Generator, temperature: float = 1.0,
           top_p: float | None = None, old: Policy | None = None, switch: torch.Tensor | None = None,
           greedy: bool = False, precision: str | None = None) -> dict[str, torch.Tensor]:
    """Batched autoregressive sampling.

    prompts [B, P] -> ``responses`` [B, T] (PAD after EOS), ``logp`` [B, T] float32 (the sampler's
    log-prob of each sampled token under the distribution it sampled from), ``mask`` [B, T] bool
    (the EOS token included), ``truncated`` [B] bool, ``from_old`` [B, T] bool, ``seconds`` [B] float64
    (wall time from the start of sampling to the decode step that ended the row). When ``old`` is
    given, rows use ``old`` for positions ``t < switch[row]`` and ``new`` after (a partial rollout:
    both models read the same tokens, so ``new`` continues from a re-encoded prefix). ``precision``:
    the sampler's numerics (see :func:`_head`).
    """
    b = prompts.shape[0]
    models = [new] if old is None else [new, old]
    outs, states = zip(*(m.encode(prompts) for m in models))
    last = [o[:, -1] for o in outs]
    states = list(states)
    responses = torch.full((b, max_len), PAD, dtype=torch.long)
    logps = torch.zeros(b, max_len)
    mask = torch.zeros(b, max_len, dtype=torch.bool)
    from_old = torch.zeros(b, max_len, dtype=torch.bool)
    alive = torch.ones(b, dtype=torch.bool)
    start = time.perf_counter()
    seconds = torch.zeros(b, dtype=torch.float64)
    for t in range(max_len):
        logits = _head(new, last[0], precision)
        if old is not None:
            use_old = t < switch
            logits = torch.where(use_old[:, None], _head(old, last[1], precision), logits)
            from_old[:, t] = use_old & alive
        logp = _sampler_logp(logits, temperature, top_p)
        if greedy:
            tok = logp.argmax(-1)
        else:
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        mask[:, t] = alive
        logps[:, t] = torch.where(alive, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        tok = torch.where(alive, tok, PAD)
        responses[:, t] = tok
        ended = alive & (tok == EOS)
        alive = alive & ~ended
        seconds = torch.where(ended | (alive & (t == max_len - 1)), time.perf_counter() - start, seconds)
        if not alive.any():
            break
        for i, m in enumerate(models):
            o, states[i] = m.encode(tok[:, None], states[i])
            last[i] = o[:, -1]
    return {"responses": responses, "logp": logps, "mask": mask, "truncated": alive, "from_old": from_old,
            "seconds": seconds}
