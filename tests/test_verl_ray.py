"""The verl integration's delivery into Ray workers: verl's own launch line composed by Hydra reaches
``ray.init`` with the setup hook, which instruments a real local Ray trainer actor without importing verl
until verl itself is imported."""

from __future__ import annotations

import math
import os
import re
import sys
import urllib.request

import pytest

from .conftest import ROOT, need_module
from ._verl_helpers import HOOK, MAX_RESPONSE, N, compose_config, make_batch


# --- delivery into Ray workers -------------------------------------------------------------------

def ray_init_kwargs_from_main_ppo(env_vars: dict, config=None) -> dict:
    """The ray.init keyword arguments that verl's own ``run_ppo`` builds from the documented
    override (``ray.init`` is intercepted; nothing else of main_ppo runs)."""
    import verl.trainer.main_ppo as main_ppo

    if config is None:
        overrides = [f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}"]
        # Quoted: Hydra would make RLWATCH_PORT=0 an int, and Ray accepts only string env_vars.
        overrides += [f'+ray_kwargs.ray_init.runtime_env.env_vars.{k}="{v}"' for k, v in env_vars.items()]
        config = compose_config(*overrides)
    captured: dict = {}

    class Captured(Exception):
        pass

    def fake_init(**kwargs):
        captured.update(kwargs)
        raise Captured

    real_init, main_ppo.ray.init = main_ppo.ray.init, fake_init
    try:
        with pytest.raises(Captured):
            main_ppo.run_ppo(config, task_runner_class=None)
    finally:
        main_ppo.ray.init = real_init
    return captured


def test_example_launch_line_composes_and_reaches_ray_init(tmp_path):
    """examples/verl_launch.sh, run with a stand-in python3 that records its arguments: verl's
    Hydra config accepts every override and run_ppo hands Ray the hook and string env_vars."""
    need_module("hydra")
    import subprocess

    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "$ARGS_OUT"\n')
    shim.chmod(0o755)
    out = tmp_path / "args"
    subprocess.run(["bash", str(ROOT / "examples" / "verl_launch.sh")], check=True, timeout=60,
                   env=dict(os.environ, PATH=f"{shim.parent}:{os.environ['PATH']}", ARGS_OUT=str(out), RUN="demo"))
    args = out.read_text().splitlines()
    assert args[:2] == ["-m", "verl.trainer.main_ppo"]
    overrides = [a for a in args[2:] if not a.startswith(("data.max_prompt_length", "data.max_response_length",
                                                          "actor_rollout_ref.rollout.n=", "trainer.experiment_name"))]
    kwargs = ray_init_kwargs_from_main_ppo({}, compose_config(*overrides))
    env = kwargs["runtime_env"]
    assert env["worker_process_setup_hook"] == HOOK
    assert env["env_vars"]["RLWATCH_RUN"] == "demo" and env["env_vars"]["RLWATCH_PORT"] == "9400"
    assert all(isinstance(v, str) for v in env["env_vars"].values())


class TrainerProcess:
    """Stands in for verl's TaskRunner actor: imports verl's metric module and calls it from a
    trainer method, like RayPPOTrainer.fit."""

    def state(self) -> dict:
        from rlwatch.integrations import verl as rv

        return {"verl_imported": "verl" in sys.modules, "instrumented": rv.INSTRUMENTOR.is_instrumented,
                "watch": rv.INSTRUMENTOR.watch is not None, "pid": os.getpid()}

    def train_step(self) -> dict:
        import verl.trainer.ppo.metric_utils as metric_utils
        from omegaconf import OmegaConf

        from rlwatch.integrations import verl as rv

        self.config = OmegaConf.create({"trainer": {"experiment_name": "ignored-env-wins"},
                                        "actor_rollout_ref": {"rollout": {"n": N, "response_length": MAX_RESPONSE}}})
        self.global_steps = 1
        metrics = metric_utils.compute_data_metrics(batch=make_batch(seed=6), use_critic=False)
        watch = rv.INSTRUMENTOR.watch
        return {"wrapped": hasattr(metric_utils.compute_data_metrics, "__rlwatch_original__"),
                "verl_metric": metrics["critic/score/mean"], "port": watch.port, "run": watch.run,
                "steps": rv.INSTRUMENTOR.last_values["steps_total"][()]}

    def close(self) -> None:
        from rlwatch.integrations import verl as rv

        rv.uninstrument()


def test_setup_hook_reaches_the_trainer_actor_through_ray(tmp_path):
    ray = need_module("ray")
    need_module("hydra")
    sd_dir = tmp_path / "targets"
    kwargs = ray_init_kwargs_from_main_ppo({"RLWATCH_RUN": "from-ray", "RLWATCH_PORT": "0",
                                            "RLWATCH_STORE": "none", "RLWATCH_SD_DIR": str(sd_dir)})
    runtime_env = kwargs["runtime_env"]
    assert runtime_env["worker_process_setup_hook"] == HOOK
    runtime_env["env_vars"]["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])
    try:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
        remote = ray.remote(num_cpus=0)(TrainerProcess)
        trainer, bystander = remote.remote(), remote.remote()
        before = ray.get(trainer.state.remote())
        assert before == {"verl_imported": False, "instrumented": True, "watch": False, "pid": before["pid"]}
        step = ray.get(trainer.train_step.remote())
        assert step["wrapped"] and step["run"] == "from-ray" and step["steps"] == 1
        assert math.isfinite(step["verl_metric"])
        body = urllib.request.urlopen(f"http://127.0.0.1:{step['port']}/metrics", timeout=10).read().decode()
        assert re.search(r'rlwatch_steps_total\{run="from-ray",run_instance="[^"]+"\} 1.0', body), body
        assert len(list(sd_dir.glob("*.json"))) == 1              # registered for Prometheus file_sd
        idle = ray.get(bystander.state.remote())
        assert idle["pid"] != before["pid"]
        assert idle == {"verl_imported": False, "instrumented": True, "watch": False, "pid": idle["pid"]}
        ray.get(trainer.close.remote())
        assert not list(sd_dir.glob("*.json"))
    finally:
        ray.shutdown()


@pytest.mark.frameworks          # verl must be installed for the hook to patch it
def test_setup_hook_imports_no_verl():
    """The worker setup hook only registers the import hook: it imports no verl."""
    code = ("import sys; import rlwatch.integrations.verl as rv; rv.setup_hook(); "
            "print(any(m == 'verl' or m.startswith('verl.') for m in sys.modules), "
            "rv.INSTRUMENTOR.is_instrumented)")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    imported, instrumented = out.stdout.split()
    assert imported == "False" and instrumented == "True", out.stderr
