"""The TRL integration's entry points: :func:`watch` / :func:`attach` / :func:`unwatch`, the
:class:`RLWatchCallback` (steps, logs, checkpoints) and the guard actions."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ...postmortem.probe import ROLLOUTS_FILE
from ...core.config import trainer_logs_enabled
from .. import _instrumentor, _trainer_logs
from .._instrumentor import caller_self, guarded
from .grpo import GRPOInstrumentor

try:  # TRL pulls in transformers; the callback base class is all this module needs from it.
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - rlwatch itself does not depend on transformers
    TrainerCallback = object  # type: ignore[assignment,misc]

logger = logging.getLogger("rlwatch")


# --- guard actions -----------------------------------------------------------------------------------

_requests: dict[str, set[str]] = {}
_requests_lock = threading.Lock()


def _request(event: Any, what: str) -> None:
    with _requests_lock:
        _requests.setdefault(str(getattr(event, "run", "")), set()).add(what)


def _take_requests(run: str) -> set[str]:
    with _requests_lock:
        return _requests.pop(run, set())


def stop_on_critical(event: Any) -> None:
    """Guard action: stop training cleanly (``control.should_training_stop``) at the next callback.

    Use as ``Watch(guard=(stop_on_critical,))`` or ``watch(trainer, guard=(stop_on_critical,))``."""
    _request(event, "stop")
    logger.warning("rlwatch: critical alert %s: requesting TRL to stop training", getattr(event, "name", "?"))


def save_on_critical(event: Any) -> None:
    """Guard action: save a checkpoint (``control.should_save``) at the next callback."""
    _request(event, "save")
    logger.warning("rlwatch: critical alert %s: requesting a TRL checkpoint", getattr(event, "name", "?"))


# --- the callback ------------------------------------------------------------------------------------

class RLWatchCallback(TrainerCallback):
    """TRL/transformers callback: observe each optimizer step, forward logs and checkpoints, apply
    guard requests.

    Usable on its own in ``GRPOTrainer(..., callbacks=[RLWatchCallback(watch)])``: at train begin it
    finds its trainer and attaches the per-token capture. ``sync_guard=True`` all-reduces guard
    requests across processes at each step end (needed with guard actions on more than one process;
    set it identically on every rank).
    """

    def __init__(self, watch: Any, instrumentor: GRPOInstrumentor | None = None, sync_guard: bool = False) -> None:
        self.watch = watch
        self.instrumentor = instrumentor
        self.sync_guard = sync_guard
        self.trainer: Any = None if instrumentor is None else instrumentor.trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            trainer = _find_trainer()
            if trainer is not None:
                attach(trainer, self.watch, callback=self)
            else:
                logger.warning("rlwatch: RLWatchCallback could not find its trainer; only logs, checkpoints and "
                               "guards are recorded (use rlwatch.integrations.trl.watch(trainer))")
        return self._apply(control)

    def on_step_end(self, args, state, control, **kwargs):
        if self.instrumentor is not None:
            guarded(self.watch, "trl_observe")(self.instrumentor.flush)(int(state.global_step))
        return self._apply(control, sync=True)

    def on_substep_end(self, args, state, control, **kwargs):
        return self._apply(control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.watch.log_scalars(int(state.global_step), _trainer_logs.without_headline(logs))
        return self._apply(control)

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.watch.record_checkpoint(int(state.global_step), path)
        return self._apply(control)

    def on_train_end(self, args, state, control, **kwargs):
        guarded(self.watch, "trl_flush")(self.watch.flush)()
        return control

    def _apply(self, control, sync: bool = False):
        requests = _take_requests(self.watch.run)
        if sync and self.sync_guard:
            requests = guarded(self.watch, "trl_guard_sync")(self._all_reduce)(requests) or requests
        if "stop" in requests:
            control.should_training_stop = True
        if "save" in requests:
            control.should_save = True
        return control

    def _all_reduce(self, requests: set[str]) -> set[str]:
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is None or accelerator.num_processes <= 1:
            return requests
        flags = torch.tensor([float("stop" in requests), float("save" in requests)], device=accelerator.device)
        flags = accelerator.reduce(flags, reduction="sum")
        return {name for name, v in zip(("stop", "save"), flags.tolist()) if v > 0}


def _find_trainer() -> Any:
    """The GRPOTrainer whose training loop is calling us (walks up the caller frames)."""
    return caller_self(sys._getframe(1), lambda obj: _is_a(obj, "GRPOTrainer") or _is_a(obj, "AsyncGRPOTrainer"),
                       16)


def _is_a(obj: Any, class_name: str) -> bool:
    """Whether ``obj`` is an instance of a class named ``class_name`` (TRL is not imported here)."""
    return any(cls.__name__ == class_name for cls in type(obj).__mro__)


# --- public entry points -----------------------------------------------------------------------------

@dataclass
class _Attachment:
    watch: Any
    callback: RLWatchCallback
    instrumentor: GRPOInstrumentor | None
    added_callback: bool
    owns_watch: bool


_attached: "weakref.WeakKeyDictionary[Any, _Attachment]" = weakref.WeakKeyDictionary()


def attach(trainer: Any, watch: Any, callback: RLWatchCallback | None = None, owns_watch: bool = False,
           sync_guard: bool = False, probe_rollouts: bool = True, trainer_logs: bool = True) -> bool:
    """Attach an existing Watch to ``trainer``. False (one warning, nothing patched) when the
    installed TRL is outside the supported range or the trainer is already watched; False, counted
    as a hook error (``integration``/``trl_instrument``), when patching it fails.

    ``probe_rollouts``: keep the first 32 sequences of the first generation batch in
    ``<output_dir>/rlwatch-probe-rollouts.safetensors`` for ``rlwatch postmortem --probe``.
    ``trainer_logs``: add the headline signals to TRL's own logs (:func:`mirror_into_log`)."""
    if trainer in _attached:
        logger.warning("rlwatch: this trainer is already watched; ignoring the second call")
        return False
    _take_requests(watch.run)                 # a request left over from an earlier run of that name
    instrumentor: GRPOInstrumentor | None = None
    if _is_a(trainer, "AsyncGRPOTrainer") or not _is_a(trainer, "GRPOTrainer"):
        logger.warning("rlwatch: %s is watched through its callbacks only (logs, checkpoints, guards); the "
                       "per-token capture supports trl.GRPOTrainer", type(trainer).__name__)
    else:
        instrumentor = GRPOInstrumentor(trainer, watch)
        output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
        if probe_rollouts and output_dir and watch.active:
            instrumentor.probe_path = os.path.join(output_dir, ROLLOUTS_FILE)
        try:
            if not instrumentor.instrument():
                return False
        except Exception as exc:  # noqa: BLE001 - a trainer we cannot patch must still train
            watch.errors.report("integration", "trl_instrument", f"{type(exc).__name__}: {exc}", exc=exc)
            return False
    added = callback is None
    if callback is None:
        callback = RLWatchCallback(watch, instrumentor, sync_guard=sync_guard)
        trainer.add_callback(callback)
    else:
        callback.instrumentor, callback.trainer = instrumentor, trainer
    _attached[trainer] = _Attachment(watch, callback, instrumentor, added, owns_watch)
    if trainer_logs and trainer_logs_enabled():
        mirror_into_log(trainer, watch)
    return True


def mirror_into_log(trainer: Any, watch: Any) -> None:
    """Add the headline signals (``rlwatch/kl_k3``, ``rlwatch/is_ess``, ...; see
    ``rlwatch.integrations._trainer_logs``) to every training log of ``trainer``: its ``log`` is
    wrapped on the instance, so they reach ``state.log_history`` and every ``report_to`` backend
    (W&B, TensorBoard, MLflow). Evaluation logs and the end-of-training summary are left alone.
    Undone by :func:`unwatch`."""
    original = trainer.log
    if getattr(original, "__rlwatch_mirror__", False):
        return

    def log(logs: dict, *args: Any, **kwargs: Any) -> Any:
        if isinstance(logs, dict) and "train_runtime" not in logs and not any(str(k).startswith("eval_") for k in logs):
            logs = guarded(watch, "trl_trainer_logs")(_trainer_logs.merged)(logs, watch) or logs
        return original(logs, *args, **kwargs)

    log.__rlwatch_mirror__ = True
    trainer.log = log


def _unmirror_log(trainer: Any) -> None:
    if getattr(vars(trainer).get("log"), "__rlwatch_mirror__", False):
        del trainer.log


def watch(trainer: Any, **watch_options: Any):
    """Create a :class:`rlwatch.Watch` for a TRL ``GRPOTrainer`` and attach it. Returns the Watch.

    ``watch_options`` go to ``Watch`` (``run``, ``port``, ``store``, ``guard``, ...), except
    ``probe_rollouts`` (default True, see :func:`attach`) and ``trainer_logs`` (default True: the
    headline signals join TRL's logs under ``rlwatch/``, see :func:`mirror_into_log`); defaults
    here: ``background=True`` when the trainer runs on an accelerator (each step is assembled and
    computed on rlwatch's thread, so the training thread never waits for the device's queue), False
    on CPU (where that thread would only compete with the trainer's own threads for the same cores:
    measured slower, see ``bench/bench_trl_overhead.py``) and with a ``guard`` (which must act at
    the step that fired),
    ``framework="trl"``, the installed TRL version, ``group_size=num_generations``, the run store
    ``<output_dir>/rlwatch.db`` and the run ``args.run_name`` (else the output directory's name),
    and the TRL settings that shape the signals as run metadata. A second call on the same trainer warns and
    returns the first Watch. On an unsupported TRL version the Watch is returned unattached (one
    warning, nothing patched).
    """
    from ...hook.watch import Watch

    existing = _attached.get(trainer)
    if existing is not None:
        zero_code = _zero_code.pop(trainer, None)
        if zero_code is not None and watch_options:
            return _replace_zero_code(trainer, existing.watch, zero_code, watch_options)
        logger.warning("rlwatch: this trainer is already watched; returning its Watch")
        return existing.watch
    version = _instrumentor.installed_version("trl") or ""
    watch_options.setdefault("framework", "trl")
    watch_options.setdefault("framework_version", version)
    num_generations = getattr(trainer, "num_generations", None)
    if num_generations:
        watch_options.setdefault("group_size", int(num_generations))
    output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
    if output_dir:
        # The run store next to the checkpoints: `rlwatch postmortem <output_dir>` finds both.
        watch_options.setdefault("store", os.path.join(output_dir, "rlwatch.db"))
        watch_options.setdefault("run", getattr(trainer.args, "run_name", None) or os.path.basename(
            os.path.normpath(output_dir)))
    metadata = dict(watch_options.pop("metadata", None) or {})
    metadata.setdefault("trl", trainer_metadata(trainer))
    probe_rollouts = bool(watch_options.pop("probe_rollouts", True))
    trainer_logs = bool(watch_options.pop("trainer_logs", True))
    watch_options.setdefault("background", not watch_options.get("guard") and trainer_device(trainer) != "cpu")
    w = Watch(metadata=metadata, **watch_options)
    attach(trainer, w, owns_watch=True, sync_guard=bool(watch_options.get("guard")), probe_rollouts=probe_rollouts,
           trainer_logs=trainer_logs)
    return w


#: Trainers that ``rlwatch run`` watched when they were built, with the options it used (RLWATCH_*).
_zero_code: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def watch_zero_code(trainer: Any, **env_options: Any) -> Any:
    """``rlwatch run``'s Watch for a trainer as it is built; a later :func:`watch` call of the script
    itself, with options, replaces it (the script's run name, guard, port... win)."""
    w = watch(trainer, **env_options)
    if _attached.get(trainer) is not None and _attached[trainer].watch is w:
        _zero_code[trainer] = dict(env_options)
    return w


def _replace_zero_code(trainer: Any, auto: Any, env_options: dict, options: dict) -> Any:
    """The script's own ``watch(trainer, ...)`` under ``rlwatch run``: its options win over the Watch
    that ``rlwatch run`` attached when the trainer was built (``rlwatch run``'s settings fill the rest),
    and it says so on stderr; once that Watch has observed a step it is kept, and that is said too."""
    import sys

    from ..registry import announce
    from ...core.run_report import report

    given = ", ".join(sorted(options))
    if auto.state.snapshot().step is not None:
        print(f"rlwatch: watch(trainer, {given}=...) came after this trainer's first step: the Watch that `rlwatch "
              f"run` attached (run {auto.run!r}) is kept and these options are not used", file=sys.stderr, flush=True)
        return auto
    unwatch(trainer)
    w = watch(trainer, **{**env_options, **options})
    report("replaced", run=auto.run, by=w.run)
    guard = " and its guard" if options.get("guard") else ""
    print(f"rlwatch: the script's own watch(trainer, {given}=...) replaces the Watch that `rlwatch run` attached "
          f"when the trainer was built: run {auto.run!r} -> {w.run!r}; the script's options{guard} are used",
          file=sys.stderr, flush=True)
    announce(w, "trl")
    return w


def trainer_device(trainer: Any) -> str | None:
    """The device type the trainer trains on ("cpu", "cuda", ...), None when it cannot be told."""
    device = getattr(getattr(trainer, "accelerator", None), "device", None)
    if device is None:
        try:
            device = trainer.args.device
        except Exception:  # noqa: BLE001 - an unusual trainer: unknown
            return None
    return getattr(device, "type", None)


def unwatch(trainer: Any, close: bool = True) -> None:
    """Undo :func:`watch` / :func:`attach`: restore the trainer's methods, remove the callback that was
    added, and close the Watch that :func:`watch` created (unless ``close=False``)."""
    attachment = _attached.pop(trainer, None)
    if attachment is None:
        return
    _unmirror_log(trainer)
    if attachment.instrumentor is not None:
        attachment.instrumentor.uninstrument()
    attachment.callback.instrumentor = None
    if attachment.added_callback:
        trainer.remove_callback(attachment.callback)
    if attachment.owns_watch and close:
        attachment.watch.close()


def trainer_metadata(trainer: Any) -> dict[str, Any]:
    """The TRL settings that decide how the signals read (stored with the run)."""
    args = getattr(trainer, "args", None)
    names = ("num_generations", "num_iterations", "steps_per_generation", "gradient_accumulation_steps",
             "per_device_train_batch_size", "max_completion_length", "beta", "loss_type", "scale_rewards",
             "use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_max", "mask_truncated_completions", "temperature", "top_p", "top_k")
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, (bool, int, float, str)) or value is None:
            if not (isinstance(value, float) and not math.isfinite(value)):
                out[name] = value
    return out

