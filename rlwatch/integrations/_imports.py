"""Post-import hooks: run a callback right after a module executes, before the importing statement
binds anything from it (so ``from x import f`` in later modules already gets the wrapped ``f``).
Used by the integrations' lazy delivery and by the zero-code bootstrap."""

from __future__ import annotations

import importlib.abc
import importlib.util
import threading
from types import ModuleType
from typing import Any, Callable, Iterable


class NotifyingLoader(importlib.abc.Loader):
    """Runs the real loader, then ``callback(module)``; attributes fall through to the real loader."""

    def __init__(self, loader: Any, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that calls ``callback(module)`` right after one of ``names`` has
    been executed, before the importing statement binds anything from it."""

    def __init__(self, names: Iterable[str], callback: Callable[[ModuleType], None]) -> None:
        self.names = frozenset(names)
        self.callback = callback
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname                      # find the real spec with the other finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = NotifyingLoader(spec.loader, self.callback)
        return spec
