"""Run in a subprocess by tests/test_openrlhf_ray.py to check how rlwatch reaches OpenRLHF's Ray workers.

``launcher``: started through ``rlwatch.integrations.openrlhf.launch([...], module=__name__)``, which
has initialised Ray with the setup hook; a Ray actor reports what it sees.

``job``: as under ``ray job submit``: the job's runtime env (setup hook, RLWATCH_* variables) is in
``RAY_JOB_CONFIG_JSON_ENV_VAR``, and OpenRLHF's real CLI runs (``train()`` calls its own ``ray.init``
with its ``env_vars``, which Ray merges with the job's); the probe replaces ``get_strategy``, the
first thing ``train()`` does after ``ray.init``, reports from a Ray actor and stops the run there.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from types import SimpleNamespace


class Probe:
    def report(self) -> dict:
        before = "openrlhf" in sys.modules
        from openrlhf.trainer.ppo_utils import experience_maker

        from rlwatch.integrations import openrlhf as ro

        method = experience_maker.RemoteExperienceMaker.make_experience_batch
        return {"openrlhf_imported_before": before, "instrumented": ro.INSTRUMENTOR.is_instrumented,
                "wrapped": getattr(method, "__rlwatch_original__", None) is not None,
                "watch": ro.INSTRUMENTOR.watch is not None, "run": os.environ.get("RLWATCH_RUN"),
                "nccl_debug": os.environ.get("NCCL_DEBUG"), "pid": os.getpid()}


def check() -> None:
    import ray

    actor = ray.remote(num_cpus=0)(Probe).remote()
    print("PROBE " + json.dumps(ray.get(actor.report.remote())), flush=True)
    ray.shutdown()


# Ray actor classes for tests/test_openrlhf_ray.py: defined here because Ray workers import the module
# that defines an actor class, and this one imports nothing from OpenRLHF.

class WorkerProcess:
    """A Ray worker like OpenRLHF's trainer actor: imports OpenRLHF's experience maker."""

    def report(self) -> dict:
        before = "openrlhf" in sys.modules
        from openrlhf.trainer.ppo_utils import experience_maker

        from rlwatch.integrations import openrlhf as worker_ro

        method = experience_maker.RemoteExperienceMaker.make_experience_batch
        return {"imported_before": before, "instrumented": worker_ro.INSTRUMENTOR.is_instrumented,
                "wrapped": getattr(method, "__rlwatch_original__", None) is not None,
                "watch": worker_ro.INSTRUMENTOR.watch is not None, "run": os.environ.get("RLWATCH_RUN"),
                "pid": os.getpid()}

    def idle(self) -> dict:
        from rlwatch.integrations import openrlhf as worker_ro

        return {"openrlhf_imported": any(m == "openrlhf" or m.startswith("openrlhf.") for m in sys.modules),
                "instrumented": worker_ro.INSTRUMENTOR.is_instrumented, "pid": os.getpid()}


class AsyncGenerator:
    """Stands in for OpenRLHF's GenerateSamplesActor (async mode, a separate process): stamps a
    response with the wrapped SamplesGenerator method, called unbound on a minimal ``self`` that
    carries only ``args`` (all that method reads)."""

    def stamp(self, args, response: dict) -> dict:
        from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

        from rlwatch.integrations import openrlhf as worker_ro

        experience = SamplesGenerator._process_response_into_experience(SimpleNamespace(args=args), response,
                                                                         max_len=32)
        return worker_ro.sample_meta(experience)



class _Stop(Exception):
    pass


def main(mode: str, argv: list[str]) -> None:
    if mode == "launcher":
        check()
        return
    import openrlhf.utils

    def get_strategy(args):
        check()
        raise _Stop

    openrlhf.utils.get_strategy = get_strategy
    sys.argv = ["train_ppo_ray", *argv]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    except _Stop:
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
