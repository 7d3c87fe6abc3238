"""The post-mortem's loader for the demo's checkpoints (``rlwatch postmortem RUN --probe`` on a run of
``rlwatch demo``), registered with :func:`rlwatch.postmortem.probe.register_loader` on import."""

from __future__ import annotations

from pathlib import Path

import torch

from ..postmortem.probe import LogitsFn, check_weights, read_state_dict, register_loader


def load_demo_checkpoint(directory: Path, config: dict) -> LogitsFn | None:
    """rlwatch's demo checkpoints: config.json names the ``architecture`` (gru or transformer) and sizes
    of :mod:`rlwatch.demo.policy`'s models; weights in model.safetensors. None for any other checkpoint."""
    if config.get("architecture") not in ("gru", "transformer") or "scenario" not in config:
        return None
    from .policy import Policy, TransformerPolicy

    def build() -> torch.nn.Module:
        if config["architecture"] == "transformer":
            return TransformerPolicy(int(config["embed_dim"]))
        return Policy(int(config["embed_dim"]), int(config["hidden_dim"]))

    state = read_state_dict(directory)
    with torch.device("meta"):
        skeleton = build()
    check_weights(skeleton, state, directory)
    del skeleton
    model = build()
    model.load_state_dict(state)
    model.eval()

    def logits(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return model.head(model.encode(ids)[0]).float()        # [N, L, V]; left padding is the demo's own
    return logits


register_loader(load_demo_checkpoint)
