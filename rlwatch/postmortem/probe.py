"""``--probe``: how far each update moved the policy, measured on a fixed set of stored rollouts.

For every checkpoint, recompute the log-prob of each stored response token, and the exact
per-token KL between consecutive checkpoints' next-token distributions on the same positions.

Checkpoints are loaded without executing anything they contain: weights come from
``model.safetensors`` (safetensors cannot carry code), or, when a directory has only a pickled
``pytorch_model.bin``, through ``torch.load(weights_only=True)``, which refuses any object that
is not a tensor; the model class comes from ``config.json`` through transformers' own registry
(never ``trust_remote_code``), or by a loader registered with :func:`register_loader` (the demo's),
and the weights are checked against that config on the meta device (no memory) before the model
is built, so a few-byte checkpoint whose config claims a large model is refused without
allocating it. A checkpoint that cannot be loaded that way is refused and reported, never
unpickled. Any other kind of checkpoint needs a loader of your own: ``--probe-loader
module:function`` (:func:`user_loader`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

#: Where the integrations keep the fixed rollouts, in the run's output directory.
ROLLOUTS_FILE = "rlwatch-probe-rollouts.safetensors"
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class UnsafeCheckpointError(RuntimeError):
    """The checkpoint's weights could only be read by unpickling arbitrary objects."""


@dataclass
class ProbeResult:
    step: int
    path: str
    mean_logp: float | None = None
    kl_to_next: float | None = None
    error: str | None = None


def save_rollouts(path: str | Path, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  response_mask: torch.Tensor) -> None:
    """Store fixed rollouts for probing: ids/masks [N, L]; response_mask marks response tokens."""
    from safetensors.torch import save_file

    save_file({"input_ids": input_ids.long().contiguous(), "attention_mask": attention_mask.long().contiguous(),
               "response_mask": response_mask.long().contiguous()}, str(path))


def load_rollouts(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    data = load_file(str(path))
    missing = {"input_ids", "attention_mask", "response_mask"} - set(data)
    if missing:
        raise ValueError(f"{path}: missing {', '.join(sorted(missing))}")
    return data


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Weights of a checkpoint directory, safely."""
    from safetensors.torch import load_file

    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(shard)))
        return state
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES and "model" in p.name)
    if not pickles:
        raise FileNotFoundError(f"{directory}: no model weights (model.safetensors)")
    try:
        state = {}
        for path in pickles:
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict):
                raise UnsafeCheckpointError(f"{path.name} does not hold a state dict")
            state.update(loaded)
        return state
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - weights_only refused something that is not a tensor
        raise UnsafeCheckpointError(f"{directory}: refused to unpickle {pickles[0].name} "
                                    f"({type(exc).__name__}); convert it to safetensors") from None


LOADERS: list[Callable[[Path, dict], LogitsFn | None]] = []


def check_weights(skeleton: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Refuse weights that do not fill the model ``config.json`` describes: every parameter present
    (a tied ``lm_head`` may be absent) with the declared shape. ``skeleton`` lives on the meta
    device: checking costs no memory, whatever size the config claims."""
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    missing = [k for k in expected if k not in state and "lm_head" not in k]
    if missing:
        raise ValueError(f"{directory}: config.json describes {len(expected)} tensors; the weights lack "
                         f"{len(missing)} of them ({', '.join(missing[:3])})")
    wrong = [(k, tuple(state[k].shape), shape) for k, shape in expected.items()
             if k in state and tuple(state[k].shape) != shape]
    if wrong:
        k, got, want = wrong[0]
        raise ValueError(f"{directory}: {len(wrong)} weights do not have the shape config.json declares "
                         f"({k}: {list(got)} stored, {list(want)} declared)")


def _hf_loader(directory: Path, config: dict) -> LogitsFn | None:
    if "model_type" not in config or str(config.get("model_type", "")).startswith("rlwatch"):
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    state = read_state_dict(directory)       # first: refuse unsafe weights before building anything
    hf_config = AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    with torch.device("meta"):               # then: check them against the config without allocating it
        skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
    check_weights(skeleton, state, directory)
    del skeleton
    model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    real_missing = [k for k in missing if "lm_head" not in k]     # tied embeddings are not stored twice
    if real_missing:
        raise ValueError(f"{directory}: weights missing for {real_missing[:3]}")
    if "lm_head.weight" in missing and hasattr(model, "tie_weights"):
        model.tie_weights()
    model.eval()

    def logits(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=attn).logits.float()
    return logits


Loader = Callable[[Path, dict], "LogitsFn | None"]


def register_loader(loader: Loader) -> None:
    """Add a built-in loader, tried after ``--probe-loader``'s (once, however often it is registered):
    whoever provides a kind of checkpoint registers its loader (the demo: :mod:`rlwatch.demo.checkpoint`)."""
    if loader not in LOADERS:
        LOADERS.append(loader)


register_loader(_hf_loader)


def user_loader(spec: str) -> Loader:
    """``module:function`` (``--probe-loader``): ``function(directory: Path, config: dict)`` returns
    ``logits(input_ids [N, L], attention_mask [N, L]) -> [N, L, V]`` for a checkpoint directory it
    knows, else None (the built-in loaders are tried next). The module is imported from the current
    directory or ``PYTHONPATH``: it runs as your code."""
    import importlib
    import sys

    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--probe-loader {spec!r}: expected module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        loader = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--probe-loader {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(loader):
        raise ValueError(f"--probe-loader {spec!r}: {name} is not callable")
    return loader


def load_policy(directory: str | Path, loaders: "tuple[Loader, ...]" = ()) -> LogitsFn:
    """The logits function of a checkpoint directory: ``loaders`` first, then the built-in ones."""
    directory = Path(directory)
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: not a JSON object")
    for loader in (*loaders, *LOADERS):
        fn = loader(directory, config)
        if fn is not None:
            return fn
    raise ValueError(f"{directory}: no loader for this checkpoint (config model_type {config.get('model_type')!r}); "
                     "pass one with --probe-loader module:function")


@torch.no_grad()
def _token_stats(logits_fn: LogitsFn, rollouts: dict[str, torch.Tensor], chunk: int
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per response token: log-prob of the stored token [M], and next-token log-distributions per chunk."""
    ids, attn, resp = rollouts["input_ids"], rollouts["attention_mask"], rollouts["response_mask"].bool()
    token_logps, dists = [], []
    for start in range(0, ids.shape[0], chunk):
        i, a, r = ids[start:start + chunk], attn[start:start + chunk], resp[start:start + chunk]
        logp = torch.log_softmax(logits_fn(i, a)[:, :-1], -1)          # predicts positions 1..L-1
        target = r[:, 1:]
        token_logps.append(logp.gather(-1, i[:, 1:, None]).squeeze(-1)[target])
        dists.append(logp[target])                                        # [m, V] for the chunk
    return torch.cat(token_logps), dists


def distinct(checkpoints: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Each checkpoint directory once, by step, however its path was spelled (absolute, relative,
    through a link): the absolute spelling is kept."""
    by_place: dict[tuple[int, str], str] = {}
    for step, path in checkpoints:
        key = (step, os.path.realpath(path))
        if key not in by_place or (os.path.isabs(path) and not os.path.isabs(by_place[key])):
            by_place[key] = path
    return sorted((step, path) for (step, _), path in by_place.items())


def probe(checkpoints: list[tuple[int, str]], rollouts_path: str | Path, chunk: int = 8,
          loaders: "tuple[Loader, ...]" = ()) -> list[ProbeResult]:
    """Score each distinct checkpoint on the stored rollouts, and the KL from each to the next
    (``loaders``: tried before the built-in ones, see :func:`user_loader`)."""
    rollouts = load_rollouts(rollouts_path)
    results: list[ProbeResult] = []
    previous: list[torch.Tensor] | None = None
    previous_result: ProbeResult | None = None
    for step, path in distinct(checkpoints):
        result = ProbeResult(step, path)
        try:
            token_logp, dists = _token_stats(load_policy(path, loaders), rollouts, chunk)
            result.mean_logp = float(token_logp.mean()) if token_logp.numel() else None
            if previous is not None and previous_result is not None:
                kl_sum, count = 0.0, 0
                for p_old, p_new in zip(previous, dists):
                    kl_sum += float((p_old.exp() * (p_old - p_new)).sum())
                    count += p_old.shape[0]
                previous_result.kl_to_next = kl_sum / count if count else None
            previous, previous_result = dists, result
        except Exception as exc:  # noqa: BLE001 - one bad checkpoint must not hide the others
            result.error = f"{type(exc).__name__}: {exc}"
            previous, previous_result = None, None
        results.append(result)
    return results
