"""TRL integration: per-token health signals from ``GRPOTrainer`` (TRL 1.15.x and 1.16.x; 1.16.0 is
the version the tests run, 1.15.0's hooked methods were checked to be identical in source).

One line::

    w = rlwatch.integrations.trl.watch(trainer)      # or callbacks=[RLWatchCallback(watch)]
    trainer.train()

What each signal is read from, at which granularity, in which configurations, and how it compares
with TRL's own logs: README, "TRL: where each signal comes from". The code is laid out by that
table's two granularities:

- ``grpo``: the patch table (``PATCHES``, attributes of the one trainer instance; the class is
  untouched) and the token-level path, once per optimizer step over every micro-batch of that
  step's ``_compute_loss`` (``GRPOInstrumentor.step_fields``). ``trainer_logp`` is exactly the
  π_old of TRL's loss: ``old_per_token_logps`` when TRL computed it, otherwise the loss forward's
  detached log-probs, which TRL substitutes for π_old (no update happened in between).
- ``generation``: the episode-level path, once per generation batch on the whole batch gathered
  over processes (:class:`Generation`), exported with the step that scored it and repeated on
  steps that score none (:class:`GenerationSignals`); truncation, environments, :func:`audited`
  checkers and the hack detectors' episodes.
- ``callback``: :func:`watch`, :func:`attach`, :func:`unwatch`, :class:`RLWatchCallback` (steps,
  logs, checkpoints) and the guard actions :func:`stop_on_critical` / :func:`save_on_critical`.

**Phases** (docs/rollout-system.md): TRL's own timing points, ``profiling_context(trainer, name)``
for generation (``vLLM.generate``, ``transformers.generate``, ``transformers.generate_batch``) and
weight sync (``sync_weights``), and ``training_step`` (what TRL sums into ``step_time``) for
training, per optimizer step. TRL keeps no per-episode duration (a batch is generated in one call).

**Steps and versions.** ``step`` is ``state.global_step`` after the update (the step TRL logs and
names checkpoints by); ``trainer_version`` is ``state.global_step`` when the loss was computed and
each sample is stamped with ``state.global_step`` at generation (``VERSION_KEY``), so ``lag``
counts the optimizer updates between generation and use. A ``rollout_func`` whose sampler holds
older weights says which with a ``policy_version`` entry in its output (``POLICY_VERSION_KEY``: one
int per completion, or one for the batch: the ``global_step`` of the weights that sampled); the
samples are stamped with it instead, and the lag is the sampler's own staleness.

Multi-process runs: a rank captures token-level data only if its Watch exports and observes its own
micro-batches; every rank takes part in the gathers of episode-level data (and of the hack
detectors' episodes, unless ``hack_detectors=False`` on every rank); with guard actions the
stop/save request is all-reduced at each step end so that every rank stops together.

Cost: one host transfer per step (``Watch.observe_fields``) and one per generation batch.
``trl.experimental.async_grpo.AsyncGRPOTrainer`` gets logs, checkpoints and guards only.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ..registry import Autoload, announce

logger = logging.getLogger("rlwatch")

#: The package's names, imported from their modules on first use: ``rlwatch run`` imports this package
#: in every process where TRL is installed (for :data:`AUTOLOAD`), which must not import torch.
_LAZY: dict[str, tuple[str, ...]] = {
    "callback": ("RLWatchCallback", "attach", "mirror_into_log", "save_on_critical", "stop_on_critical",
                 "trainer_device", "trainer_metadata", "unwatch", "watch"),
    "generation": ("ENV_COLUMNS", "GENERATION_FAMILIES", "MAX_ENV_SCALARS", "PROBE_ROWS", "STEP_EPISODE_FAMILIES",
                   "UNSCORABLE", "VERSION_KEY", "POLICY_VERSION_KEY",
                   "AuditedReward", "Generation", "GenerationSignals", "audit_verdicts",
                   "audited", "env_labels", "env_labels_present", "eos_and_pad", "episodes", "truncation_flags",
                   "hack_episode_inputs", "judges_hacks", "reported_versions", "sampler_versions"),
    "grpo": ("GATHER_ONLY", "PATCHES", "SUPPORTED", "GRPOInstrumentor", "MicroBatch", "sampling_fields"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME) | set(_LAZY))


def _watch_new_trainer(module: Any) -> None:
    """``rlwatch run``: every GRPOTrainer built in this process gets a Watch when its constructor returns."""
    cls = getattr(module, "GRPOTrainer", None)
    if cls is None or getattr(cls.__init__, "__rlwatch_original__", None) is not None:
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            from ...core.config import env_watch_options
            from .callback import watch_zero_code

            announce(watch_zero_code(self, **env_watch_options()), "trl")
        except Exception as exc:  # noqa: BLE001 - never stop the user's trainer from being built
            logger.warning("rlwatch: could not watch this GRPOTrainer: %s", exc)

    __init__.__rlwatch_original__ = original
    cls.__init__ = __init__


#: ``rlwatch run``'s registration (:mod:`rlwatch.integrations.registry`): hook GRPOTrainer's constructor
#: once TRL's GRPO trainer module is imported.
AUTOLOAD = Autoload(framework="trl", setup=_watch_new_trainer, on_import="trl.trainer.grpo_trainer")

__all__ = ["watch", "unwatch", "attach", "audited", "AuditedReward", "RLWatchCallback", "GRPOInstrumentor",
           "stop_on_critical", "save_on_critical"]
