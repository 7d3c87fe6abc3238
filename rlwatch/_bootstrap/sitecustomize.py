"""Loaded by Python at start-up when ``rlwatch run`` put this directory on PYTHONPATH."""

import importlib.util
import os
import sys

try:
    import rlwatch.autoload

    rlwatch.autoload.initialize()
except Exception as exc:  # noqa: BLE001 - never prevent the user's program from starting
    print(f"rlwatch: instrumentation disabled: {exc}", file=sys.stderr)
    if isinstance(exc, ImportError) and os.environ.get("RLWATCH_RUN_REPORT"):
        try:   # tell `rlwatch run` (the reporting of rlwatch.autoload, which did not import)
            import json

            with open(os.environ["RLWATCH_RUN_REPORT"], "a", encoding="utf-8") as _report:
                _report.write(json.dumps({"event": "unavailable", "pid": os.getpid(), "python": sys.executable,
                                          "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        except OSError:
            pass

# Chain to the sitecustomize this one shadows (a distribution's or a virtual environment's).
_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    if os.path.abspath(_entry or ".") == _here:
        continue
    _candidate = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_rlwatch_chained_sitecustomize", _candidate)
        if _spec and _spec.loader:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
