"""The life cycle every integration shares, after OpenTelemetry's ``BaseInstrumentor``, and the
one wrapper every patch goes through.

An integration declares the framework package, the versions it supports (``supported``, a
``packaging`` specifier set such as ``">=0.9,<0.10"``) and a table of :class:`Patch` entries:
(owner, attribute, :class:`Hook`). ``instrument()`` checks the installed version and refuses with
one clear log line (nothing patched) outside that range; a second call warns and does nothing;
``uninstrument()`` restores every original attribute from the patch-restore registry.

Every patched function is :meth:`Instrumentor.wrap`: it calls the original with the arguments it
was given (a ``before`` hook may swap one argument for a copy with rlwatch's keys added: the
trainer-logs mirror) and returns its result untouched. The hooks around it only read the call's
inputs and output. Each hook runs under ``guarded``: an error on rlwatch's side goes to the Watch's
``HookErrors`` (counted in ``rlwatch_hook_errors_total``; logged as a warning while there is no
Watch), never into the trainer (unless the Watch is strict). Hooks run on the thread that calls
the patched function (the trainer's); what they hand to the Watch may then be computed on
rlwatch's own thread (``Watch(background=True)``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
import logging
import os
import sys
import threading
from dataclasses import dataclass, replace
from types import FrameType, ModuleType
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

from ..config import disabled, env_watch_options, rank
from ..errors import guarded as errors_guarded

logger = logging.getLogger("rlwatch")


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_supported(version: str, supported: str) -> bool:
    """Whether ``version`` satisfies the specifier set ``supported`` (development and pre-releases of
    a supported release count; an unparsable version does not)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:
        return SpecifierSet(supported).contains(version, prereleases=True)
    except InvalidVersion:
        return False


# --- the patch table ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hook:
    """What a patched function does besides calling the original. ``before``, ``after`` and
    ``around`` name methods of the instrumentor: ``before(call)`` and ``after(call)`` (the original's
    return value in ``call.result``) run guarded under ``kind``; ``around(call)`` returns a context
    manager entered around the original (not guarded: it must not raise, so it only sets flags or a
    context variable). ``watch=True``: the hooks need the Watch, created on this call if there is none yet
    (:meth:`RayActorInstrumentor.resolve`); they are skipped when none could be created."""

    kind: str
    before: str | None = None
    after: str | None = None
    around: str | None = None
    watch: bool = False


class Patch(NamedTuple):
    """One row of an integration's table: ``owner`` (a class name in the target module or object,
    None for the target itself), the attribute replaced, and its hook."""

    owner: str | None
    attribute: str
    hook: Hook


class Call:
    """One call of a patched function, as the hooks see it: positional ``args`` (``self`` first for
    a method patched on a class), ``kwargs``, the calling frame, the result once the original
    returned, and ``state`` / ``context`` / ``watch`` that the hooks of this one call share."""

    __slots__ = ("args", "kwargs", "caller", "result", "state", "context", "watch")

    def __init__(self, args: tuple, kwargs: dict, caller: FrameType | None) -> None:
        self.args, self.kwargs, self.caller = args, kwargs, caller
        self.result: Any = None
        self.state: Any = None
        self.context: Any = None
        self.watch: Any = None

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """The argument passed as ``name=`` or at position ``index``."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[index] if len(self.args) > index else default

    def replace_arg(self, index: int, name: str, value: Any) -> None:
        """Pass ``value`` to the original in place of the argument ``name`` / at ``index``."""
        if name in self.kwargs or len(self.args) <= index:
            self.kwargs[name] = value
        else:
            self.args = (*self.args[:index], value, *self.args[index + 1:])


@contextlib.contextmanager
def context_value(variable: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """``variable`` set to ``value`` inside the block (an ``around`` hook's usual body)."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


# --- the instrumentor -----------------------------------------------------------------------------

class Instrumentor:
    """Base class: subclasses set ``package`` and ``supported`` and implement ``_instrument(**kwargs)``
    / ``_uninstrument()``, patching with :meth:`patch` (or :meth:`apply` for a whole table)."""

    package: str = ""
    supported: str = ""

    def __init__(self) -> None:
        self._instrumented = False
        self._originals: list[tuple[Any, str, Any, bool]] = []
        self.watch: Any = None

    @property
    def is_instrumented(self) -> bool:
        return self._instrumented

    def instrument(self, **kwargs: Any) -> bool:
        """Patch the framework; False (with one warning) when already done or unsupported. A Ray-actor
        integration takes ``watch`` (report to this Watch instead of creating one) and ``Watch``
        keyword arguments for the Watch it creates."""
        if self._instrumented:
            logger.warning("rlwatch: %s is already instrumented; ignoring the second call", self.package)
            return False
        version = installed_version(self.package)
        if version is None:
            logger.warning("rlwatch: %s is not installed; nothing patched", self.package)
            return False
        if not version_supported(version, self.supported):
            logger.warning("rlwatch: the %s integration supports %s %s, found %s; nothing patched",
                           self.package, self.package, self.supported, version)
            return False
        try:
            self._instrument(**kwargs)
        except Exception:
            self._restore()
            raise
        self._instrumented = True
        logger.info("rlwatch: instrumented %s %s", self.package, version)
        return True

    def uninstrument(self) -> None:
        """Restore every patched attribute (and, for Ray actors, remove the import hook and close the
        Watch rlwatch created)."""
        if not self._instrumented:
            return
        self._uninstrument()
        self._restore()
        self._instrumented = False

    def _instrument(self, **kwargs: Any) -> None:
        raise NotImplementedError

    def _uninstrument(self) -> None:
        pass

    # the patch-restore registry

    def apply(self, target: Any, patches: Iterable[Patch]) -> None:
        """Patch every row of ``patches`` on ``target`` (a module or an object)."""
        for owner, attribute, hook in patches:
            self.patch(target if owner is None else getattr(target, owner), attribute, hook)

    def patch(self, owner: Any, name: str, hook: Hook) -> None:
        """Replace ``owner.name`` with :meth:`wrap` of it; restored by ``uninstrument``."""
        self.replace(owner, name, self.wrap(getattr(owner, name), hook))

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering what to restore (or delete) on ``uninstrument``."""
        had = name in vars(owner) if hasattr(owner, "__dict__") else True
        self._originals.append((owner, name, getattr(owner, name) if had else None, had))
        setattr(owner, name, value)

    def _restore(self) -> None:
        for owner, name, original, had in reversed(self._originals):
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._originals.clear()

    # the one wrapper

    def wrap(self, original: Callable, hook: Hook) -> Callable:
        """The function that replaces ``original``: the original alone once uninstrumented, else
        ``before`` -> (``around``) original -> ``after``, each hook guarded (see the module docstring)."""
        instrumentor = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not instrumentor._instrumented:
                return original(*args, **kwargs)
            call = Call(args, kwargs, sys._getframe(1))
            if hook.before is not None:
                instrumentor._run(hook, hook.before, call)
            around = getattr(instrumentor, hook.around)(call) if hook.around else contextlib.nullcontext()
            with around:
                call.result = original(*call.args, **call.kwargs)
            if hook.after is not None:
                instrumentor._run(hook, hook.after, call)
            return call.result

        functools.update_wrapper(wrapper, original)
        wrapper.__rlwatch_original__ = original
        return wrapper

    def _run(self, hook: Hook, method: str, call: Call) -> None:
        if hook.watch:
            if call.watch is None:
                call.watch = self.resolve(call)
            if call.watch is None:
                return
        guarded(self.watch, hook.kind)(getattr(self, method))(call)

    def resolve(self, call: Call) -> Any:
        """The Watch the hooks of ``call`` report to (see :class:`RayActorInstrumentor`)."""
        return self.watch


# --- Ray actors --------------------------------------------------------------------------------------

def framework_watch_options(framework: str, environ: Mapping[str, str] | None = None, run: Any = None,
                            group_size: Any = None) -> dict[str, Any]:
    """``Watch`` keyword arguments of a Ray-actor integration: the framework and its version, the
    RLWATCH_* variables (:func:`env_watch_options`), then the run name and group size from the
    trainer's configuration where the variables give none (RLWATCH_GROUP_SIZE wins, even 0: no groups)."""
    opts: dict[str, Any] = {"framework": framework, "framework_version": installed_version(framework) or ""}
    opts.update(env_watch_options(environ))
    run = opts.get("run") or run
    if run:
        opts["run"] = str(run)
    n = opts.pop("group_size") if "group_size" in opts else group_size
    if n and int(n) > 1:
        opts["group_size"] = int(n)
    return opts


def caller_self(frame: FrameType | None, accept: Callable[[Any], bool], depth: int) -> Any:
    """The first ``self`` that ``accept`` takes among ``depth`` frames from ``frame`` outwards, else None."""
    while frame is not None and depth > 0:
        candidate = frame.f_locals.get("self")
        if candidate is not None and accept(candidate):
            return candidate
        frame, depth = frame.f_back, depth - 1
    return None


def config_get(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b.c`` for a DictConfig, a dict or nested namespaces; ``default`` when a part is missing."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
        except Exception:  # noqa: BLE001 - a struct DictConfig raises on unknown keys
            return default
    return default if node is None else node


def episode_dicts(fields: Any, extras: list[dict], response_ids: list | None = None) -> list[dict[str, Any]]:
    """One reward-hack detector episode per sample of a step's ``StepFields``: environment
    ("default" without labels), reward (0.0 without rewards), truncation (False without flags), the
    per-sample ``extras[i]`` and, where known, ``response_ids[i]``."""
    B = int(fields.mask.shape[0])
    rewards = fields.rewards.double().cpu().tolist() if fields.rewards is not None else [0.0] * B
    env = fields.env or ["default"] * B
    truncated = fields.truncated.tolist() if fields.truncated is not None else [False] * B
    out = []
    for i in range(B):
        episode = {"env": str(env[i]), "reward": rewards[i], "truncated": bool(truncated[i]), "extra": extras[i]}
        if response_ids is not None and response_ids[i] is not None:
            episode["response_ids"] = response_ids[i]
        out.append(episode)
    return out


def pad_cat(tensors: list[Any], width: int) -> Any:
    """Concatenate [b_i, T_i] tensors along the batch, right-padding narrower ones to ``width`` with
    zeros (a wider one is left as it is, for the record's validation to report)."""
    import torch

    padded = [t if t.shape[1] >= width else torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
    return padded[0] if len(padded) == 1 else torch.cat(padded)


def version_pairs(first: Iterable[Any], last: Iterable[Any]) -> Any:
    """[B, 2] int64 (first, last) policy versions per sample, or None when any sample lacks one."""
    import torch

    first, last = list(first), list(last)
    if not first or any(v is None for v in first) or any(v is None for v in last):
        return None
    return torch.tensor([[int(a), int(b)] for a, b in zip(first, last)], dtype=torch.int64)


class RayActorInstrumentor(Instrumentor):
    """An instrumentor delivered into every Ray worker by an import hook (verl, OpenRLHF), because
    their trainer loops run in Ray actors that a patch made in the launcher never reaches.

    :meth:`setup_hook` (Ray's ``worker_process_setup_hook``, run in every worker) only checks the
    version and installs an import hook: it imports nothing from the framework and starts nothing.
    When a process imports one of the modules of ``patches`` ({module name: [Patch, ...]}), their
    rows are patched; a wrapper that is never called costs nothing. The first call whose hook needs
    the Watch (``Hook(watch=True)``, made only by the trainer process) creates the process's Watch
    (its ``/metrics`` endpoint, run store and file_sd registration) from RLWATCH_* variables and the
    trainer's configuration; every other worker keeps idle wrappers and no endpoint. Ray places the
    trainer on any node: set ``RLWATCH_SD_DIR`` (a directory Prometheus reads through ``file_sd``)
    and, across hosts, ``RLWATCH_ADDR=0.0.0.0``.

    Subclasses set ``patches`` and ``label`` and implement ``_context(call)`` (the trainer object or
    arguments behind a call), ``_watch_options(context)`` and ``_watch_metadata(context)``."""

    patches: Mapping[str, list[Patch]] = {}
    label = ""

    def __init__(self) -> None:
        super().__init__()
        self.last_values: dict | None = None
        self._own_watch = False
        self._watch_kwargs: dict[str, Any] = {}
        self._watch_lock = threading.Lock()
        self._watch_failed = False
        self._finder: Any = None
        self._fallback_step = 0

    def _instrument(self, watch: Any = None, **watch_kwargs: Any) -> None:
        """``watch``: report to this Watch instead of creating one (from RLWATCH_*, the trainer's
        configuration and ``watch_kwargs``) when a hook first needs it."""
        from ._imports import PostImportFinder

        self.watch = watch
        self._own_watch = False
        self._watch_kwargs = watch_kwargs
        self._watch_failed = False
        for name in self.patches:
            module = sys.modules.get(name)
            if module is not None:
                self._patch_module(module)
        self._finder = PostImportFinder(self.patches, self._on_import)
        sys.meta_path.insert(0, self._finder)

    def _uninstrument(self) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        if self._own_watch and self.watch is not None:
            self.watch.close()
        self.watch = None
        self._own_watch = False

    def _on_import(self, module: ModuleType) -> None:
        if not self._instrumented:
            return
        try:
            self._patch_module(module)
        except Exception as exc:  # noqa: BLE001 - an import must never fail because of rlwatch
            logger.warning("rlwatch: could not instrument %s: %s", module.__name__, exc)

    def _patch_module(self, module: ModuleType) -> None:
        """Patch the table's rows for ``module``; a missing target turns that hook off (one warning)."""
        for owner_name, attribute, hook in self.patches.get(module.__name__, ()):
            owner = module if owner_name is None else getattr(module, owner_name, None)
            current = getattr(owner, attribute, None) if owner is not None else None
            if current is None or hasattr(owner, "__ray_metadata__"):   # Ray pickles actor classes by value
                where = ".".join(filter(None, (module.__name__, owner_name, attribute)))
                logger.warning("rlwatch: %s not found (or a Ray actor class) in %s %s; that hook is off",
                               where, self.package, installed_version(self.package))
            elif getattr(current, "__rlwatch_original__", None) is None:
                self.patch(owner, attribute, hook)

    def resolve(self, call: Call) -> Any:
        if call.context is None:
            call.context = self._context(call)
        return self._get_watch(call.context)

    def _context(self, call: Call) -> Any:
        raise NotImplementedError

    def _get_watch(self, context: Any = None) -> Any:
        """The process's Watch, created on first use (None, with one warning, if that failed)."""
        if self.watch is not None or self._watch_failed:
            return self.watch
        with self._watch_lock:
            if self.watch is None and not self._watch_failed:
                try:
                    self.watch = self._make_watch(context)
                    self._own_watch = True
                except Exception as exc:  # noqa: BLE001
                    self._watch_failed = True
                    logger.warning("rlwatch: could not start the Watch in this %s process: %s", self.label, exc)
        return self.watch

    def _make_watch(self, context: Any) -> Any:
        import atexit

        from ..watch import Watch

        opts = self._watch_options(context)
        opts.update(self._watch_kwargs)
        opts.setdefault("metadata", self._watch_metadata(context))
        if "all_ranks" not in opts and rank()[0] != 0:
            # The trainer actor is the only caller; a RANK/SLURM_PROCID it inherited from the node's
            # launcher must not silence it (the run label then carries a -rankN suffix).
            opts["all_ranks"] = True
        watch = Watch(**opts)
        atexit.register(watch.close)
        logger.info("rlwatch: %s trainer process %d exports at %s", self.label, os.getpid(), watch.url)
        return watch

    def _watch_options(self, context: Any) -> dict[str, Any]:
        raise NotImplementedError

    def step_or_count(self, step: Any) -> int:
        """``step`` when the framework gives one (an int), else the next of this process's own count."""
        if isinstance(step, int):
            return step
        self._fallback_step += 1
        return self._fallback_step

    def observe(self, step: int, fields: Any, episodes: Callable[[Any], list] | None = None) -> None:
        """Hand one step's ``StepFields`` to the Watch (with ``episodes(fields)`` for the reward-hack
        detectors when it runs them) and keep its values in ``last_values``; nothing for None."""
        if fields is None:
            return
        if episodes is not None and getattr(self.watch, "hack_detection", False):
            fields = replace(fields, episodes=episodes(fields))
        self.last_values = self.watch.observe_fields(step, fields)

    def _watch_metadata(self, context: Any) -> dict[str, Any]:
        return {}

    def setup_hook(self) -> None:
        """Ray ``worker_process_setup_hook``: check the version and install the import hook, nothing
        more (the framework is not imported, no Watch is created). Never raises: a failing setup hook
        would stop the worker from starting. RLWATCH_DISABLE=1 turns it off."""
        try:
            if disabled() or self.is_instrumented:
                return
            self.instrument()
        except Exception as exc:  # noqa: BLE001
            logger.warning("rlwatch: %s setup hook failed; this worker is not instrumented: %s", self.label, exc)

    def __reduce__(self) -> tuple:
        # A wrapper pickled by value (cloudpickle) refers to the instrumentor of the process that
        # unpickles it (the module's INSTRUMENTOR), never to this one's Watch, locks and threads.
        return (_module_instrumentor, (type(self).__module__,))


def _module_instrumentor(module: str) -> RayActorInstrumentor:
    import importlib

    return importlib.import_module(module).INSTRUMENTOR


def guarded(watch: Any, kind: str) -> Callable[[Callable], Callable]:
    """Decorator: run rlwatch's side of a hook without ever raising into the trainer (the one policy of
    :mod:`rlwatch.errors`; the Watch's error counter is looked up at each call)."""
    return errors_guarded(lambda: getattr(watch, "errors", None), "integration", kind)


__all__ = ["Call", "Hook", "Instrumentor", "Patch", "RayActorInstrumentor", "caller_self", "config_get",
           "context_value", "env_watch_options", "episode_dicts", "framework_watch_options", "guarded",
           "installed_version", "pad_cat", "version_pairs", "version_supported"]
