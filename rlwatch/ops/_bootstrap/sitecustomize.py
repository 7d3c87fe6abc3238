"""Loaded by Python at start-up when ``rlwatch run`` put this directory on PYTHONPATH."""

import importlib.util
import os
import sys

try:
    import rlwatch.ops.autoload

    rlwatch.ops.autoload.initialize()
except Exception as exc:  # noqa: BLE001 - never prevent the user's program from starting
    print(f"rlwatch: instrumentation disabled: {exc}", file=sys.stderr)
    if isinstance(exc, ImportError):
        try:   # tell `rlwatch run`; rlwatch.core.config needs only the standard library: loaded from its file
            import json

            _config_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "core", "config.py")
            _spec = importlib.util.spec_from_file_location("_rlwatch_bootstrap_config", _config_file)
            _config = importlib.util.module_from_spec(_spec)
            sys.modules[_spec.name] = _config             # for its dataclasses
            _spec.loader.exec_module(_config)
            if _config.run_report_path():
                with open(_config.run_report_path(), "a", encoding="utf-8") as _report:
                    _report.write(json.dumps({"event": "unavailable", "pid": os.getpid(), "python": sys.executable,
                                              "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        except Exception:  # noqa: BLE001
            pass
        finally:
            sys.modules.pop("_rlwatch_bootstrap_config", None)

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
