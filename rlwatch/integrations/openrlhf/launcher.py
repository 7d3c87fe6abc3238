"""The OpenRLHF launcher: ``python -m rlwatch.integrations.openrlhf <OpenRLHF arguments>`` initialises Ray with
rlwatch's worker setup hook, then runs OpenRLHF's CLI unchanged (see the package docstring)."""

from __future__ import annotations

import sys
from typing import Any, Mapping

from ...core.config import rlwatch_variables, variables_or_defaults

#: Ray's ``worker_process_setup_hook``: the instrumentor's, installed in every worker.
HOOK = "rlwatch.integrations.openrlhf.setup_hook"
#: OpenRLHF's own ``ray.init`` environment (``cli/train_ppo_ray.py``), kept by the launcher.
OPENRLHF_ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN",
                         "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}


# --- the launcher --------------------------------------------------------------------------------

def ray_runtime_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``runtime_env`` the launcher passes to ``ray.init``: the setup hook, OpenRLHF's own
    ``env_vars`` (respecting values already set, as OpenRLHF does) and every RLWATCH_* variable."""
    env_vars = variables_or_defaults(OPENRLHF_ENV_DEFAULTS, environ)
    env_vars.update(rlwatch_variables(environ))
    return {"worker_process_setup_hook": HOOK, "env_vars": env_vars}


def launch(argv: list[str] | None = None, module: str = "openrlhf.cli.train_ppo_ray") -> None:
    """Initialise Ray with rlwatch's setup hook, then run OpenRLHF's CLI ``module`` as ``__main__``
    with ``argv`` (OpenRLHF skips its own ``ray.init`` when Ray is initialised). ``RAY_ADDRESS``
    selects an existing cluster as usual."""
    import runpy

    import ray

    argv = list(sys.argv[1:] if argv is None else argv)
    if not ray.is_initialized():
        ray.init(runtime_env=ray_runtime_env())
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
