"""Runs :func:`~rlwatch.signals.fused.token_core` compiled when a compiled version is ready, eagerly
otherwise, and compiles it off the caller's thread so that no step ever waits for a compilation.

Compiled functions are shared by the whole process, one per *signature* (device, dtypes, which
inputs are present, quantile method). Shapes are dynamic, so batch and sequence sizes do not
recompile. The step's thread only ever runs code already compiled (``torch._dynamo.run``): a guard
that fails there runs the eager function instead of compiling. A compilation that fails (no C++
compiler, an unsupported backend) is remembered and its signature stays eager; the reason is kept
in :func:`status`.

The compiling thread is not a daemon: a process that exits while a compilation runs waits for it
(seconds on a GPU host), because killing a thread inside the compiler aborts the interpreter.

``RLWATCH_COMPILE`` chooses: ``auto`` (default: compile for CUDA tensors only), ``always`` (also on
CPU; inductor emits C++ there and needs a compiler), ``never``.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from typing import Any, Callable

import torch

from . import fused

log = logging.getLogger("rlwatch.signals")

_lock = threading.Lock()
_compiled: dict[tuple, Callable[..., torch.Tensor]] = {}     # ready to run
_pending: dict[tuple, threading.Thread] = {}                 # compiling in the background
_failed: dict[tuple, str] = {}                               # signature -> why it stays eager


def compile_mode(override: str | None = None) -> str:
    """``auto``, ``always`` or ``never`` from ``override`` or ``RLWATCH_COMPILE``."""
    from ..config import compile_variable

    value = (override or compile_variable() or "auto").strip().lower()
    return {"1": "always", "true": "always", "yes": "always", "0": "never", "false": "never",
            "no": "never"}.get(value, value if value in ("auto", "always", "never") else "auto")


def wants_compile(device: torch.device, override: str | None = None) -> bool:
    mode = compile_mode(override)
    return mode == "always" or (mode == "auto" and device.type == "cuda")


def signature(args: tuple[Any, ...], exact: bool) -> tuple | None:
    """What a compiled function is specialised on; None when the inputs should run eagerly
    (sizes 0 or 1, which dynamic shapes specialise, or non-contiguous tensors)."""
    mask, trainer, sampler, version = args[:4]
    B, T = mask.shape
    if B < 2 or T < 2:
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
    return tuple(key)


def _fresh_core() -> Callable[..., torch.Tensor]:
    """A copy of token_core with its own code object: dynamo keeps compiled code and its
    recompilation limit per code object, so each signature gets its own."""
    code = fused.token_core.__code__
    fn = types.FunctionType(code.replace(), fused.token_core.__globals__, code.co_name,
                            fused.token_core.__defaults__, fused.token_core.__closure__)
    fn.__kwdefaults__ = fused.token_core.__kwdefaults__
    return fn


# Example sizes compiled for each signature. Inductor picks some lowerings by size (a scatter-add
# into a 4,097-bin or 65,536-bin histogram is lowered differently when it has more indices than
# bins), which dynamo guards as bounds on B * T; compiling one example on each side of those bounds
# covers every step size.
EXAMPLE_SIZES = ((3, 5), (2, 3000), (2, 40000))


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


def _compile(key: tuple, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        fn = torch.compile(_fresh_core(), dynamic=True, fullgraph=True)
        for B, T in EXAMPLE_SIZES:
            example = _example(args, B, T)
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


def run(args: tuple[Any, ...], exact: bool, compile: str | None = None, *, eager: bool = True,
        wait: bool = False) -> tuple[torch.Tensor | None, bool]:
    """token_core(*args[:-1], exact_quantiles=exact, over_from=args[-1]) and whether the compiled
    version ran; (None, False) when no compiled version is ready and ``eager`` is False. Starts a
    background compilation for the signature on first sight when compiling is wanted; ``wait``
    blocks until it finishes (tests and benchmarks)."""
    kwargs = dict(exact_quantiles=exact, over_from=args[-1])
    call_args = args[:-1]
    mask = args[0]
    key = signature(args, exact) if wants_compile(mask.device, compile) else None
    if key is not None:
        with _lock:
            fn = _compiled.get(key)
            thread = _pending.get(key)
            start = fn is None and thread is None and key not in _failed
            if start:
                thread = _pending[key] = threading.Thread(
                    target=_compile, args=(key, _example_spec(call_args), kwargs), name="rlwatch-compile")
        if start:
            thread.start()
        if fn is None and wait and thread is not None:
            thread.join()
            fn = _compiled.get(key)
        if fn is not None:
            return fn(*call_args, **kwargs), True
    if not eager:
        return None, False
    return fused.token_core(*call_args, **kwargs), False


def status() -> dict[str, Any]:
    """Signatures compiled, compiling and failed (with the reason), for diagnostics and tests."""
    with _lock:
        return {"compiled": list(_compiled), "compiling": list(_pending), "failed": dict(_failed)}


def wait(timeout: float | None = None) -> None:
    """Block until the background compilations started so far finish (benchmarks, tests)."""
    with _lock:
        threads = list(_pending.values())
    for thread in threads:
        thread.join(timeout)
