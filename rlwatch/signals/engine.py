"""Runs :func:`~rlwatch.signals.fused.step_core` (the token signals and, when given, the episode
signals of a step, as one function) compiled when a compiled version is ready, eagerly otherwise,
and compiles it off the caller's thread so that no step ever waits for a compilation.

Compiled functions are shared by the whole process, one per *signature* (device, dtypes, which
inputs are present, quantile method, number of hack detectors, the caller's intra-op thread
count). Shapes are dynamic, so batch, sequence and environment counts do not recompile (steps of
fewer than 3 sequences run eagerly). The step's thread only ever runs code already compiled
(``torch._dynamo.run``): a guard that fails there runs the eager function instead of compiling. A
compilation that fails (no C++ compiler, an unsupported backend) is remembered and its signature
stays eager; the reason is kept in :func:`status`.

Dynamo guards every compiled graph on the intra-op thread count of the thread that traced it, so
the calling thread's count is part of the signature, and the compiling thread takes that count
before the caller goes on (the caller's eager step changes the process-wide default that a new
thread starts from, which made the traced count, and so whether steps ran compiled, a race).

The compiling thread is not a daemon: a process that exits while a compilation runs waits for it
(seconds on a GPU host), because killing a thread inside the compiler aborts the interpreter.

The Workspace's ``compile`` (a Watch passes ``RLWATCH_COMPILE``) chooses: ``auto`` (default: compile for CUDA
tensors only), ``always`` (also on CPU; inductor emits C++ there and needs a compiler), ``never``.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from typing import Any, Callable

import torch

from . import fused, settings

log = logging.getLogger("rlwatch.signals")

_lock = threading.Lock()
_compiled: dict[tuple, Callable[..., torch.Tensor]] = {}     # ready to run
_pending: dict[tuple, threading.Thread] = {}                 # compiling in the background
_failed: dict[tuple, str] = {}                               # signature -> why it stays eager
_traced: dict[tuple, list[tuple[int, int]]] = {}             # signature -> the [B, T] sizes compiled, in order
#: The torch.compile backend (tests trace with a lighter one).
BACKEND = "inductor"


def compile_mode(override: str | None = None) -> str:
    """``auto`` (also for None), ``always`` or ``never`` from ``override`` (the Workspace's ``compile``: the
    caller reads ``RLWATCH_COMPILE``)."""
    value = (override or "auto").strip().lower()
    return {"1": "always", "true": "always", "yes": "always", "0": "never", "false": "never",
            "no": "never"}.get(value, value if value in ("auto", "always", "never") else "auto")


def wants_compile(device: torch.device, override: str | None = None) -> bool:
    mode = compile_mode(override)
    return mode == "always" or (mode == "auto" and device.type == "cuda")


#: The episode inputs of :func:`fused.step_core`, in order.
EPISODE_INPUTS = ("ok", "rewards", "group_ids", "env_index", "env_slots", "truncated", "hacked", "bounds")


def signature(args: tuple[Any, ...], exact: bool, episodes: tuple[Any, ...] | None = None) -> tuple | None:
    """What a compiled function is specialised on; None when the inputs should run eagerly
    (sizes 0 or 1, which dynamic shapes specialise, or non-contiguous tensors). ``episodes``: the
    :data:`EPISODE_INPUTS` tensors (each may be None) or None for the token signals alone."""
    mask, trainer, sampler, version = args[:4]
    B, T = mask.shape
    if B < 3 or T < 2:          # dynamic shapes specialise sizes 0 and 1 (B - 1 in the episode block)
        return None
    # Dynamo guards on each tensor's dispatch keys: inference tensors and normal ones compile apart.
    key: list[Any] = [mask.device, mask.dtype, exact,
                      tuple(t.is_inference() for t in args[:5] if isinstance(t, torch.Tensor))]
    for t in (trainer, sampler, version):
        if t is None:
            key.append(None)
            continue
        if not t.is_contiguous() or t.device != mask.device:
            return None
        if t is version:
            kind = "token" if t.shape == mask.shape else ("pair" if t.dim() == 2 else "seq")
            if kind == "pair" and t.shape[-1] != 2:
                return None
            key.append((t.dtype, kind))
        else:
            key.append(t.dtype)
    if not mask.is_contiguous():
        return None
    if episodes is not None:
        for name, t in zip(EPISODE_INPUTS, episodes):
            if t is None:
                key.append(None)
                continue
            if not t.is_contiguous() or t.device != mask.device or (name == "env_slots" and t.numel() < 2):
                return None
            # The number of detectors is part of the signature (a dimension of 1 is specialised).
            key.append((t.dtype, t.is_inference(), t.shape[0] if name == "hacked" else None))
    # Last: the calling thread's intra-op thread count, which dynamo guards (see the module's notes).
    return (*key, torch.get_num_threads())


def _fresh_core() -> Callable[..., torch.Tensor]:
    """A copy of step_core with its own code object: dynamo keeps compiled code and its
    recompilation limit per code object, so each signature gets its own."""
    core = fused.step_core
    code = core.__code__
    fn = types.FunctionType(code.replace(), core.__globals__, code.co_name, core.__defaults__, core.__closure__)
    fn.__kwdefaults__ = core.__kwdefaults__
    return fn


# Example sizes compiled for each signature. Inductor picks some lowerings by size (a scatter-add
# into a 4,097-bin or 65,536-bin histogram is lowered differently when it has more indices than
# bins), which dynamo guards as bounds on B * T; compiling one example on each side of those bounds
# covers every step size (guards seen on CPU: B * T <= 4,096, >= 32,767, >= 65,536). The episode
# block's sorts are lowered differently above 4,096 episodes: the last example covers large batches
# of large steps (more than 4,096 episodes and 65,536 positions; a step with more than 4,096 episodes
# but fewer positions runs eagerly). Dynamo also guards equal sizes as equal ("duck sizing"), so no
# example size may equal another input's size (see _example_sizes).
EXAMPLE_SIZES = ((13, 17), (14, 700), (14, 3000), (14, 40000), (4500, 20))


def _example_sizes(args: tuple[Any, ...], episodes: tuple[Any, ...] | None,
                   own: tuple[int, int] | None = None) -> tuple[list[tuple[int, int]], int]:
    """The sizes compiled for a signature: ``own`` first (the size of the step that asked for it:
    inductor sizes its kernels, the reductions' splits and blocks, by the hints of the first trace of
    a graph, so the graph the steps of that size run is traced at their size), then EXAMPLE_SIZES
    (steps whose size fails its graph's guards); and the example's number of environment slots. Each
    is moved off the sizes of the fixed inputs (thresholds, constants, bounds, hack detectors), so that
    no equality between them is guarded."""
    taken = {t.shape[0] for t in args[4:] if isinstance(t, torch.Tensor) and t.dim() == 1} | {2, 3}
    if episodes is not None and episodes[EPISODE_INPUTS.index("hacked")] is not None:
        taken.add(episodes[EPISODE_INPUTS.index("hacked")][3])
    slots = 4
    while slots in taken:
        slots += 1
    taken.add(slots)
    sizes = []
    for B, T in ((own,) if own else ()) + EXAMPLE_SIZES:
        while B in taken:
            B += 1
        while T in taken or T == B:
            T += 1
        sizes.append((B, T))
    return sizes, slots


def _example(args: tuple[Any, ...], B: int = 3, T: int = 5) -> tuple[Any, ...]:
    """Inputs [B, T] with the dtypes, devices, layout and inference-ness of ``args``, so the
    compilation neither reads nor keeps the caller's tensors."""
    mask, trainer, sampler, version = args[:4]
    device = mask.device
    g = torch.Generator().manual_seed(0)

    def like(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
        if t is None:
            return None
        with torch.inference_mode(t.is_inference()):
            if t.dtype.is_floating_point:
                return (-torch.rand(shape, generator=g)).to(t.dtype).to(device)
            return torch.randint(0, 3, shape, generator=g).to(t.dtype).to(device)

    with torch.inference_mode(mask.is_inference()):
        ex_mask = (torch.rand(B, T, generator=g) < 0.8).to(mask.dtype).to(device)

    if version is None:
        ex_version = None
    elif version.shape == mask.shape:
        ex_version = like(version, (B, T))
    else:
        ex_version = like(version, (B, 2) if version.dim() == 2 else (B,))
    return (ex_mask, like(trainer, (B, T)), like(sampler, (B, T)), ex_version, *args[4:])


def _example_episodes(spec: tuple[Any, ...] | None, B: int, slots: int = 4) -> tuple[Any, ...]:
    """Episode inputs for B episodes with the dtypes, devices and inference-ness of ``spec`` (from
    :func:`_episode_spec`): a few groups and environments, some failures."""
    if spec is None:
        return (None,) * len(EPISODE_INPUTS)
    g = torch.Generator().manual_seed(1)
    out = []
    for name, s in zip(EPISODE_INPUTS, spec):
        if s is None or isinstance(s, torch.Tensor):          # None, or bounds (kept as is)
            out.append(s)
            continue
        dtype, device, inference, rows = s
        shape = {"hacked": (rows, B), "env_slots": (slots,)}.get(name, (B,))
        high = {"group_ids": max(B // 2, 2), "env_index": 3}.get(name, 2)
        with torch.inference_mode(inference):
            if dtype.is_floating_point:
                value = torch.randint(0, 3, shape, generator=g).to(dtype).to(device)
            else:
                value = torch.randint(0, high, shape, generator=g).to(dtype).to(device)
        out.append(value)
    return tuple(out)


def _episode_spec(episodes: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """What :func:`_example_episodes` needs, without keeping the caller's tensors alive."""
    if episodes is None:
        return None
    return tuple(None if t is None else (t if name == "bounds" else
                                         (t.dtype, t.device, t.is_inference(), t.shape[0] if t.dim() == 2 else None))
                 for name, t in zip(EPISODE_INPUTS, episodes))


def _example_spec(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What :func:`_example` needs of ``args`` without keeping the caller's [B, T] tensors alive:
    empty tensors of the same dtypes, devices, layout and inference-ness, and the rest as is."""
    spec = []
    for i, t in enumerate(args[:4]):
        if t is None:
            spec.append(None)
            continue
        with torch.inference_mode(t.is_inference()):
            shape = (0, 0) if t.shape == args[0].shape else ((0, 2) if t.dim() == 2 else (0,))
            spec.append(torch.empty(shape, dtype=t.dtype, device=t.device))
    return (*spec, *args[4:])


def _compiling_thread(ready: threading.Event, key: tuple, *args: Any) -> None:
    """The compiling thread: takes the caller's thread count (``key[-1]``), lets the caller go on,
    then compiles."""
    try:
        # A new thread starts from the process-wide default; dynamo's global-state guard compares the count.
        settings.set_this_threads_intra_op_threads(key[-1])
    except Exception:   # noqa: BLE001 -- at worst the signature's steps run eagerly, never a failed run
        log.debug("rlwatch: could not set the compiling thread's intra-op threads", exc_info=True)
    finally:
        ready.set()         # the caller may go on (and change the default) from here
    _compile(key, *args)


def _compile(key: tuple, args: tuple[Any, ...], kwargs: dict[str, Any],
             episodes: tuple[Any, ...] | None = None, own: tuple[int, int] | None = None) -> None:
    try:
        fn = torch.compile(_fresh_core(), dynamic=True, fullgraph=True, backend=BACKEND)
        sizes, slots = _example_sizes(args, episodes, own)
        with _lock:
            _traced[key] = sizes
        for B, T in sizes:
            example = (*_example(args, B, T), *_example_episodes(episodes, B, slots))
            with torch.inference_mode():         # as compute_step runs
                fn(*example, **kwargs)
            del example
        run_only = torch._dynamo.run(fn)
        with _lock:
            _compiled[key] = run_only
    except Exception as exc:   # noqa: BLE001 -- a failed compilation leaves the eager path, never the run
        with _lock:
            _failed[key] = f"{type(exc).__name__}: {exc}"[:500]
        if sys.is_finalizing() or "shutdown" in str(exc):     # the process is exiting: nothing to tell
            return
        log.warning("rlwatch: compiling the signal engine failed for %s; staying eager: %s", key, exc)
    finally:
        with _lock:
            _pending.pop(key, None)


def run(args: tuple[Any, ...], exact: bool, compile: str | None = None, *, wait: bool = False,
        episodes: tuple[Any, ...] | None = None) -> torch.Tensor:
    """step_core(*args[:-1], *episodes, exact_quantiles=exact, over_from=args[-1]), compiled when a
    compiled version is ready (the vector says which ran: :class:`.plans.TokenLayout`'s ``compiled``).
    ``episodes``: the :data:`EPISODE_INPUTS` (None: the token signals alone). Starts a background
    compilation for the signature on first sight when compiling is wanted; ``wait`` blocks until it
    finishes (tests and benchmarks)."""
    kwargs = dict(exact_quantiles=exact, over_from=args[-1])
    call_args = (*args[:-1], *(episodes if episodes is not None else (None,) * len(EPISODE_INPUTS)))
    mask = args[0]
    key = signature(args, exact, episodes) if wants_compile(mask.device, compile) else None
    if key is not None:
        with _lock:
            fn = _compiled.get(key)
            thread = _pending.get(key)
            start = fn is None and thread is None and key not in _failed
            if start:
                ready = threading.Event()
                thread = _pending[key] = threading.Thread(
                    target=_compiling_thread, args=(ready, key, _example_spec(args[:-1]), kwargs,
                                                    _episode_spec(episodes), tuple(mask.shape)),
                    name="rlwatch-compile")
        if start:
            thread.start()
            ready.wait()            # briefly: the thread takes its count before this step changes the default
        if fn is None and wait and thread is not None:
            thread.join()
            fn = _compiled.get(key)
        if fn is not None:
            return fn(*call_args, **kwargs)
    return fused.step_core(*call_args, **kwargs)


def status() -> dict[str, Any]:
    """Signatures compiled, compiling and failed (with the reason), and the [B, T] sizes each was
    compiled at, in order (``traced``), for diagnostics and tests."""
    with _lock:
        return {"compiled": list(_compiled), "compiling": list(_pending), "failed": dict(_failed),
                "traced": dict(_traced)}


def wait(timeout: float | None = None) -> None:
    """Block until the background compilations started so far finish (benchmarks, tests)."""
    with _lock:
        threads = list(_pending.values())
    for thread in threads:
        thread.join(timeout)
