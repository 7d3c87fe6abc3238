"""The OpenRLHF integration against the real openrlhf package (0.11.2, and 0.11.0 in a subprocess) on CPU.

Run with OpenRLHF's own environment (``scripts/setup-openrlhf-venv.sh``)::

    .venv-openrlhf/bin/python -m pytest tests/test_openrlhf_*.py

OpenRLHF's real classes run a small training loop in one local Ray instance (see
``tests/_openrlhf_mini.py``): its argument parser, ``SamplesGenerator``, agent executors,
``BasePPOTrainer.train_step`` / ``broadcast_to_vllm`` / ``save_logs_and_checkpoints``,
``RemoteExperienceMaker``, ``Actor`` and ``PolicyLoss``; only vLLM's engine actor and the DeepSpeed
GPU actor group are CPU stand-ins. ``flash_attn`` and ``vllm`` cannot be installed on a CPU machine;
when they are missing, the test-only import stubs in ``tests/openrlhf_stubs`` (see its README) let
OpenRLHF's modules import. Without openrlhf the module is skipped, unless
RLWATCH_REQUIRE_FRAMEWORKS=1 (CI), where it fails.

Tests marked ``openrlhf_versions`` also run against OpenRLHF 0.11.0 (its source unpacked by the
setup script into ``.venv-openrlhf/openrlhf-0.11.0``) in a subprocess: see
``test_version_sensitive_tests_pass_on_openrlhf_0_11_0`` in
tests/test_openrlhf_lifecycle.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .conftest import ROOT, need_module
# First: it puts the import stubs (and the 0.11.0 source) on the path, or skips without openrlhf.
from ._values import assert_values_close
from ._openrlhf_helpers import (ARGV_IS, N, OLD_API, _pythonpath, build, checkpoints,
                                expected_fields, minimal_args, scalars, steps, versions)

ray = need_module("ray")

from rlwatch import SignalConfig, Watch, compute  # noqa: E402
from rlwatch.integrations import openrlhf as ro  # noqa: E402

from . import _openrlhf_mini as mini  # noqa: E402
from . import openrlhf_probe as probe  # noqa: E402


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance whose workers get rlwatch's setup hook (as a user's job would). Its
    processes inherit PYTHONPATH (the import stubs, when used), as every job connecting to it needs."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _pythonpath()
    # Ray's OOM killer judges the whole machine's memory, which other work on a shared CI host may
    # fill; these workers are small, so it is off for this test instance.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={
        "worker_process_setup_hook": ro.HOOK,
        "env_vars": {"PYTHONPATH": _pythonpath(), "RLWATCH_RUN": "from-ray", "RLWATCH_PORT": "none",
                     "RLWATCH_STORE": "none"}})
    if saved is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = saved
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def watch(tmp_path):
    """OpenRLHF instrumented in this process, reporting to a strict Watch with a run store."""
    w = Watch(run="openrlhf-test", port=None, store=str(tmp_path / "run.db"), strict=True, group_size=N,
              alerts=False)
    assert ro.instrument(watch=w)
    try:
        yield w
    finally:
        ro.uninstrument()
        w.close()


# --- a real training loop ------------------------------------------------------------------------

@versions
def test_training_steps_observed_values_equal_compute(ray_session, watch, tmp_path):
    run = build(tmp_path, [*ARGV_IS, "--logger.tensorboard_dir", str(tmp_path / "tb")])
    config = SignalConfig(group_size=N)
    k3 = {}
    for step in (1, 2, 3):
        status, (samples, experiences) = mini.run_step(run)
        values = ro.INSTRUMENTOR.last_values
        k3[step] = values["mismatch_kl_k3"][()]
        want = compute(config, step=step, **expected_fields(run, samples, experiences, (step - 1, step - 1), step - 1))
        assert_values_close(values, want)
        # Sync mode: every sample comes from the weights broadcast after the previous step.
        assert values["trainer_version"][()] == step - 1
        assert values["version_lag_max"][()] == 0.0
        # OpenRLHF's own step statistics agree with rlwatch's.
        assert values["reward_mean"][()] == pytest.approx(status["rollout/reward_mean"])
        assert values["truncated_ratio"][()] == pytest.approx(status["rollout/truncated_rate"])
        assert values["mismatch_kl_k1"][()] == pytest.approx(status["vllm_kl"], abs=2e-3)   # vllm_kl on pi_old
        logged = scalars(watch, step)
        assert logged["policy_loss"] == pytest.approx(status["policy_loss"])
        assert logged["rollout/reward_mean"] == pytest.approx(status["rollout/reward_mean"])
        assert "extra_logs/hit" in logged and "extra_logs/words" in logged
        hits = torch.cat([e.info["hit"] for e in experiences]).double().mean()
        assert logged["extra_logs/hit"] == pytest.approx(float(hits))
    assert set(values["env_reward_mean"]) == {("gsm8k",), ("math",)}
    assert steps(watch) == [1, 2, 3]                      # OpenRLHF's global_step after each train_step
    assert checkpoints(watch) == [(2, str(tmp_path / "ckpt" / "_actor" / "global_step2"))]
    assert run.group.saved == [str(tmp_path / "ckpt" / "_actor" / "global_step2")]
    assert watch.errors.total() == 0
    # The headline signals reached OpenRLHF's own TensorBoard logs, under rlwatch/, each step's values.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run.trainer.tensorboard_logger.close()
    (events,) = {p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")}
    board = EventAccumulator(str(events))
    board.Reload()
    assert {e.step: e.value for e in board.Scalars("train/rlwatch/kl_k3")} == pytest.approx(k3)
    tags = set(board.Tags()["scalars"])
    assert {"train/rlwatch/is_ess", "train/rlwatch/version_lag_max", "train/policy_loss"} <= tags
    assert not any(name.startswith("rlwatch/") for name in scalars(watch, 3))     # not stored back


def test_lag_counts_weight_broadcasts_between_generation_and_training(ray_session, watch, tmp_path):
    run = build(tmp_path)                                       # no IS correction: no sampler log-probs
    mini.run_step(run)
    samples, _, _, _ = run.generator.generate_samples(**run.generate_kwargs)       # generated at version 1
    run.trainer.broadcast_to_vllm()                                                # two weight syncs later
    run.trainer.broadcast_to_vllm()
    assert ray.get(run.engine.update_weights.remote(run.group.actor.model.state_dict())) == 4
    status, run.global_step = run.trainer.train_step(samples, run.global_step)
    fields, values = ro.INSTRUMENTOR.last_fields, ro.INSTRUMENTOR.last_values
    assert "sampler_logp" not in fields and "logprobs_mode" not in fields
    assert fields["seq_version"].unique().tolist() == [1] and fields["trainer_version"] == 3
    assert values["version_lag_mean"][()] == 2.0 and values["version_lag_max"][()] == 2.0
    assert values["token_version_lag"][("2",)] == values["tokens"][()]
    assert watch.errors.total() == 0


def test_phases_are_openrlhfs_own_step_timers(ray_session, watch, tmp_path):
    """The step is observed when train_step returns, with OpenRLHF's timing/make_experience,
    timing/ppo_train and timing/broadcast (to the engine) and the generate_samples block it times as
    timing/generation; a train_step that raises is still observed, without phases."""
    run = build(tmp_path)
    status, _ = mini.run_step(run)
    values = ro.INSTRUMENTOR.last_values
    assert values["phase_seconds"][("training",)] == status["timing/ppo_train"]
    assert values["phase_seconds"][("make_experience",)] == status["timing/make_experience"]
    assert values["weight_sync_seconds"][()] == status["timing/broadcast"] == values["phase_seconds"][("sync",)]
    assert values["phase_seconds"][("generation",)] > 0
    samples, _, _, _ = run.generator.generate_samples(**run.generate_kwargs)
    run.trainer.ppo_train = lambda global_step: 1 / 0                       # fails after make_experience
    with pytest.raises(ZeroDivisionError):
        run.trainer.train_step(samples, run.global_step)
    assert steps(watch) == [1, 2] and "phase_seconds" not in ro.INSTRUMENTOR.last_values
    assert watch.errors.total() == 0


def test_dynamic_filtering_drops_are_launched_but_not_trained(ray_session, watch, tmp_path):
    """With --algo.dynamic_filtering_enable, the groups OpenRLHF filters out (mean score outside the
    range; replaced by new prompts) are the step's dropped episodes, reason ``filtered``: their number
    is what OpenRLHF's prompts_consumed and kept samples imply."""
    run = build(tmp_path, ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "1.5"])
    samples, _, consumed, _ = run.generator.generate_samples(**run.generate_kwargs)
    run.trainer.train_step(samples, run.global_step)
    values = ro.INSTRUMENTOR.last_values
    dropped = sum((values.get("episodes_dropped_total") or {}).values())
    assert dropped == consumed * N - len(samples) > 0                     # all-miss groups filtered out
    assert {reason for _, reason in values["episodes_dropped_total"]} == {"filtered"}
    assert sum(values["episodes_launched_total"].values()) == len(samples) + dropped
    assert sum(values["episodes_trained_total"].values()) == len(samples)
    if dropped:
        assert values["length_bias_length_ratio"][()] > 0
    assert watch.errors.total() == 0


@versions
def test_partial_rollout_stamps_dispatch_and_collection_versions(ray_session, watch, tmp_path):
    """A broadcast lands while samples are in flight (async + partial rollouts): each sample carries
    (version at dispatch, version at collection); the lag counts from the first."""
    run = build(tmp_path, ARGV_IS)
    gen, kwargs = run.generator, run.generate_kwargs
    prompts = gen.prompts_dataloader.dataset.prompts[:2]
    labels = gen.prompts_dataloader.dataset.labels[:2]
    refs = gen._dispatch_prompts_to_vllm(prompts, labels, **kwargs)                 # at version 0
    run.trainer.broadcast_to_vllm()                                                 # version 1
    samples = [gen._process_response_into_experience(r, **kwargs) for ref in refs for r in ray.get(ref)]
    assert [ro.sample_meta(s)["version"] for s in samples] == [(0, 1)] * (2 * N)
    run.trainer.broadcast_to_vllm()                                                 # version 2
    run.trainer.train_step(samples, 0)
    values = ro.INSTRUMENTOR.last_values
    assert ro.INSTRUMENTOR.last_fields["seq_version"].tolist() == [[0, 1]] * (2 * N)
    assert values["version_lag_max"][()] == 2.0 and values["version_lag_sequence_max_mean"][()] == 2.0
    assert watch.errors.total() == 0


@versions
def test_agent_extra_logs_and_truncation(ray_session, watch, tmp_path):
    """Multi-turn agent executor: extra_logs become framework scalars; truncation comes from vLLM's
    finish reason (0.11.1+) or, as 0.11.0's agent executor reports none, from the context filling up."""
    run = build(tmp_path, ["--data.max_len", "14"], agent=True)
    status, (samples, experiences) = mini.run_step(run)
    fields = ro.INSTRUMENTOR.last_fields
    index = [i for e in experiences for i in e.index]
    openrlhf_flag = torch.cat([e.truncated for e in experiences]).bool()
    context_full = torch.cat([e.info["response_clip_ratio"] for e in experiences]).bool()
    kinds = {ro.sample_meta(samples[i])["truncation"] for i in index}
    if OLD_API:
        assert kinds == {"context"} and not openrlhf_flag.any()     # 0.11.0 loses the finish reason
        assert torch.equal(fields["truncated"], context_full)
    else:
        assert kinds == {"finish_reason"}
        assert torch.equal(fields["truncated"], openrlhf_flag)
    assert fields["truncated"].any()
    logged = scalars(watch, 1)
    assert logged["extra_logs/turns"] == pytest.approx(
        float(torch.cat([e.info["turns"] for e in experiences]).double().mean()))
    assert watch.errors.total() == 0


def _run_steps(tmp_path: Path, steps: int) -> dict:
    run = build(tmp_path, ARGV_IS, seed=3)
    statuses = []
    for _ in range(steps):
        status, (_, experiences) = mini.run_step(run)
        statuses.append({k: v for k, v in status.items() if not k.startswith("timing/")})
    return {"statuses": statuses, "weights": {k: v.clone() for k, v in run.group.actor.state_dict().items()},
            "losses": run.group.loss_outputs,
            "advantages": [e.advantages.clone() for e in experiences]}


@versions
def test_the_hook_never_changes_openrlhfs_numbers(ray_session, tmp_path):
    plain = _run_steps(tmp_path / "plain", 2)
    w = Watch(run="numbers", port=None, store=None, strict=True, group_size=N, alerts=False)
    assert ro.instrument(watch=w)
    try:
        hooked = _run_steps(tmp_path / "hooked", 2)
        assert ro.INSTRUMENTOR.last_values["trainer_version"][()] == 1
    finally:
        ro.uninstrument()
        w.close()
    assert plain["statuses"] == hooked["statuses"]
    assert plain["advantages"]
    for a, b in zip(plain["advantages"], hooked["advantages"], strict=True):
        assert torch.equal(a, b)
    assert plain["weights"].keys() == hooked["weights"].keys()
    assert all(torch.equal(plain["weights"][k], hooked["weights"][k]) for k in plain["weights"])
    # PolicyLoss's outputs (0.11.0: loss, clip_ratio, ppo_kl, vllm_kl; 0.11.1+: + is_filter_ratio).
    assert len(plain["losses"][0]) == (4 if OLD_API else 5)
    for a, b in zip(plain["losses"], hooked["losses"], strict=True):
        assert len(a) == len(b)
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


# The training verifier passes every response; an independent checker, logged per sample in the
# reward function's extra_logs as ``true_pass``, fails every math one (the prompts file names each
# prompt's datasource).
REWARD_TRUE_PASS_PY = '''
import json, os

with open(os.path.join(os.path.dirname(__file__), "prompts.jsonl")) as f:
    SOURCE = {row["input"]: row["datasource"] for row in map(json.loads, f)}


def reward_func(queries, prompts, labels):
    hit = float(labels[0] in queries[0][len(prompts[0]):].split())
    return {"rewards": 1.0, "scores": 1.0,
            "extra_logs": {"hit": hit, "true_pass": float(SOURCE[prompts[0]] != "math")}}
'''


@versions
def test_extra_logs_true_pass_reaches_the_hack_detectors(ray_session, watch, tmp_path):
    """Per-sample extra_logs returned with the reward travel, through OpenRLHF's real rollout and
    train_step, with each episode to the Watch's reward-hack detectors: a ``true_pass`` logged there
    is the independent checker's verdict, counted by ``verifier_disagreement`` per environment."""
    run = build(tmp_path, ARGV_IS, reward_py=REWARD_TRUE_PASS_PY)
    status, (samples, experiences) = mini.run_step(run)
    env = expected_fields(run, samples, experiences, None, None)["env"]     # from OpenRLHF's dataset
    assert set(env) == {"gsm8k", "math"}, env                              # both verdicts occur
    true_pass = torch.cat([e.info["true_pass"] for e in experiences])       # as OpenRLHF recorded them
    assert true_pass.tolist() == [float(s != "math") for s in env]
    assert scalars(watch, 1)["extra_logs/true_pass"] == pytest.approx(float(true_pass.mean()))
    watch.hacks.flush()
    watch.observe(99, mask=torch.ones(1, 1))            # verdicts are exported with the next step
    counters = watch.state.snapshot().counters
    hacked, judged = counters.get("episodes_hacked_total", {}), counters.get("episodes_judged_total", {})
    assert hacked.get(("math", "verifier_disagreement"), 0) == env.count("math") > 0, hacked
    assert hacked.get(("gsm8k", "verifier_disagreement"), 0) == 0, hacked
    assert judged.get(("gsm8k", "verifier_disagreement"), 0) == env.count("gsm8k") > 0, judged
    assert watch.errors.total() == 0


# --- delivery into Ray workers -------------------------------------------------------------------

def test_setup_hook_reaches_a_ray_actor_that_imports_the_experience_maker(ray_session):
    remote = ray.remote(num_cpus=0)(probe.WorkerProcess)
    trainer, bystander = remote.remote(), remote.remote()
    idle = ray.get(bystander.idle.remote())
    assert idle["instrumented"] and not idle["openrlhf_imported"]       # lazy: nothing imported
    seen = ray.get(trainer.report.remote())
    assert seen["pid"] != os.getpid() and seen["pid"] != idle["pid"]
    assert seen == {"imported_before": False, "instrumented": True, "wrapped": True, "watch": False,
                    "run": "from-ray", "pid": seen["pid"]}
    for actor in (trainer, bystander):
        ray.kill(actor)


def test_async_mode_shares_the_version_across_processes(ray_session, watch, tmp_path):
    args = minimal_args("--train.async_enable", "--rollout.n_samples_per_prompt", "1")
    response = {"prompt": "w3 w4", "label": "w5", "observation_tokens": [3, 4, 5, 6], "action_ranges": [(2, 4)],
                "rollout_log_probs": None, "reward": 1.0, "scores": 1.0, "truncated": True, "extra_logs": {}}
    generator = ray.remote(num_cpus=0)(probe.AsyncGenerator).remote()
    first = ray.get(generator.stamp.remote(args, response))
    # The trainer process broadcasts: BasePPOTrainer.broadcast_to_vllm, called unbound on a minimal
    # ``self`` (its args and a policy group whose broadcast does nothing: there is no vLLM here).
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    group = SimpleNamespace(async_run_method=lambda method_name, **kw: [ray.put(None)])
    trainer = SimpleNamespace(args=args, actor_model_group=group)
    for _ in range(3):
        BasePPOTrainer.broadcast_to_vllm(trainer)
    second = ray.get(generator.stamp.remote(args, response))
    clock = ro.INSTRUMENTOR.clock(args)
    assert isinstance(clock, ro.RayClock) and clock.read() == 3
    assert first["clock"] == second["clock"] == clock.id
    # (dispatch, collection): no dispatch went through this process, so both stamps are the collection's.
    assert first["version"] == (0, 0) and second["version"] == (3, 3)
    assert second["truncated"] is True and second["truncation"] == "finish_reason"
    ray.kill(generator)
    ray.kill(clock.handle)
    ro.INSTRUMENTOR._ray_clock = None


def _run_probe(args: list[str], env: dict) -> dict:
    return _run_probe_command([sys.executable, *args], env)


def _run_probe_command(command: list[str], env: dict) -> dict:
    out = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=str(ROOT),
                         env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return json.loads(lines[-1][len("PROBE "):])


def _probe_env(**extra: str) -> dict:
    """The probe's environment: its driver connects to this module's Ray instance (RAY_ADDRESS, as
    with ``ray start`` / ``ray job submit``) as a new job, with its own runtime env."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLWATCH_")}
    env.update(PYTHONPATH=_pythonpath(), RLWATCH_RUN="probe-run", RAY_ADDRESS=ray.get_runtime_context().gcs_address,
               **extra)
    return env


def test_launcher_initialises_ray_with_the_hook_and_the_openrlhf_env(ray_session):
    code = ("from rlwatch.integrations.openrlhf import launch; "
            "launch(['launcher'], module='tests.openrlhf_probe')")
    seen = _run_probe(["-c", code], _probe_env(NCCL_DEBUG="INFO"))
    assert seen["instrumented"] and seen["wrapped"] and not seen["watch"] and not seen["openrlhf_imported_before"]
    assert seen["run"] == "probe-run" and seen["nccl_debug"] == "INFO"        # OpenRLHF's own env kept


def test_job_runtime_env_merges_with_openrlhfs_own_ray_init(ray_session):
    """``ray job submit --runtime-env-json`` hands the driver the job's runtime env in
    RAY_JOB_CONFIG_JSON_ENV_VAR; OpenRLHF's real ``train()`` calls ``ray.init(runtime_env={env_vars})``
    and Ray merges the two (the job manager itself is not started here)."""
    job = {"runtime_env": {"worker_process_setup_hook": ro.HOOK,
                           "env_vars": {"RLWATCH_RUN": "job-run", "PYTHONPATH": _pythonpath()}}}
    env = _probe_env(RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps(job))
    env.pop("RLWATCH_RUN")
    seen = _run_probe(["-m", "tests.openrlhf_probe", "job", "--actor.model_name_or_path", "x",
                       "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
                       "--algo.advantage.estimator", "reinforce"], env)
    assert seen["instrumented"] and seen["wrapped"] and seen["run"] == "job-run"
    assert seen["nccl_debug"] == "WARN"                                    # set by OpenRLHF's ray.init


def test_zero_code_rlwatch_run_reaches_openrlhfs_workers(ray_session):
    """``rlwatch run -- python -m openrlhf.cli.train_ppo_ray ...``: the bootstrap extends OpenRLHF's
    own ``ray.init`` with rlwatch's worker setup, which sets this integration up in the workers."""
    rlwatch_cli = Path(sys.executable).parent / "rlwatch"
    seen = _run_probe_command([str(rlwatch_cli), "run", "--run", "zero-code", "--", sys.executable, "-m",
                               "tests.openrlhf_probe", "job", "--actor.model_name_or_path", "x",
                               "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
                               "--algo.advantage.estimator", "reinforce"], _probe_env())
    assert seen["instrumented"] and seen["wrapped"] and not seen["watch"] and seen["run"] == "zero-code"
    assert seen["nccl_debug"] == "WARN"
