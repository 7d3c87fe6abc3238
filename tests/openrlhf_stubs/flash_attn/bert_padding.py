"""TEST-ONLY CPU implementations of flash-attn 2.8's ``bert_padding`` helpers that OpenRLHF imports
(``openrlhf/models/ring_attn_utils.py``): the same shapes and return values, with torch indexing."""

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of ``input`` ([total, ...] -> [len(indices), ...])."""
    return input[indices]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """[b, s, ...] + mask [b, s] -> (tokens [nnz, ...], indices, cu_seqlens, max_seqlen, used_seqlens)."""
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = rearrange(hidden_states, "b s ... -> (b s) ...")
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: [nnz, ...] -> [batch, seqlen, ...] with zeros elsewhere."""
    output = torch.zeros((batch * seqlen, *hidden_states.shape[1:]), dtype=hidden_states.dtype,
                         device=hidden_states.device)
    output[indices] = hidden_states
    return rearrange(output, "(b s) ... -> b s ...", b=batch)
