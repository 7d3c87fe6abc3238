"""TEST-ONLY: flash-attn's ``all_gather`` (forward only) over ``torch.distributed``."""

import torch
import torch.distributed as dist


def all_gather(input_: torch.Tensor, process_group) -> torch.Tensor:
    """Concatenate ``input_`` from every rank of ``process_group`` along the first dimension."""
    world_size = dist.get_world_size(process_group)
    output = torch.empty(world_size * input_.shape[0], *input_.shape[1:], dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(output, input_.contiguous(), group=process_group)
    return output
