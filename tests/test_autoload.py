"""`rlwatch run -- <command>`: the bootstrap reaches plain subprocesses and Ray workers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, need_module


def rlwatch_run(*command: str, extra: tuple[str, ...] = (), timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlwatch", "run", *extra, "--", *command],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.frameworks          # the bootstrap instruments installed trl and ray
def test_plain_subprocess_gets_the_bootstrap_and_config():
    probe = textwrap.dedent("""
        import json, os, sys
        import rlwatch.ops.autoload as a
        print(json.dumps(dict(loaded="rlwatch.ops.autoload" in sys.modules, initialized=a._initialized,
                              hooks=sorted(a._hooks), options=a.watch_options_from_env())))
    """)
    result = rlwatch_run(sys.executable, "-c", probe, extra=("--run", "zero-code", "--port", "0"))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["initialized"]
    assert "ray" in info["hooks"] and "trl.trainer.grpo_trainer" in info["hooks"]
    assert info["options"]["run"] == "zero-code" and info["options"]["port"] == 0


def test_exit_code_and_missing_command():
    assert rlwatch_run(sys.executable, "-c", "raise SystemExit(3)").returncode == 3
    assert rlwatch_run("definitely-not-a-command-xyz").returncode == 127


def test_ray_workers_load_the_bootstrap():
    need_module("ray")
    script = textwrap.dedent("""
        import json, os, ray
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

        @ray.remote
        def probe():
            import sys
            return dict(pid=os.getpid(), loaded="rlwatch.ops.autoload" in sys.modules,
                        run=os.environ.get("RLWATCH_RUN"))

        print(json.dumps(dict(driver=os.getpid(), worker=ray.get(probe.remote()))))
        ray.shutdown()
    """)
    result = rlwatch_run(sys.executable, "-c", script, extra=("--run", "ray-zero-code", "--port", "0"))
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["worker"]["pid"] != info["driver"]
    assert info["worker"]["loaded"] and info["worker"]["run"] == "ray-zero-code"


def test_zero_code_trl_run_gets_watched(tmp_path):
    """`rlwatch run -- python train.py` on an unmodified TRL script: the trainer exports and stores."""
    need_module("trl")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests._trl_tiny import build_tiny_model, make_trainer
        trainer = make_trainer(build_tiny_model({str(tmp_path)!r}), {str(tmp_path / "out")!r}, max_steps=2)
        trainer.train()
    """))
    result = rlwatch_run(sys.executable, str(script), extra=("--port", "0"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # It says where the metrics and the store are, while the run starts and again at the end.
    store_path = tmp_path / "out" / "rlwatch.db"
    assert "rlwatch: watching trl run 'out': metrics http://127.0.0.1:" in result.stderr
    assert "rlwatch run: watched trl run 'out'" in result.stderr
    assert f"store {store_path} (rlwatch postmortem {store_path})" in result.stderr
    from rlwatch.runs.store import StoreReader

    with StoreReader(str(tmp_path / "out" / "rlwatch.db")) as store:
        run = store.runs()[0]
        assert run == "out" and store.meta(run)["framework"] == "trl"
        assert [r.step for r in store.steps(run)] == [1, 2]


def test_the_scripts_own_watch_call_wins_under_rlwatch_run(tmp_path):
    """A script that calls `watch(trainer, run=..., guard=...)` itself, under `rlwatch run`: its run name
    and guard are used (not `rlwatch run`'s Watch, named after the output directory, without a guard),
    and stderr says what replaced what."""
    need_module("trl")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        import rlwatch.integrations.trl as rt
        from tests._trl_tiny import build_tiny_model, make_trainer
        trainer = make_trainer(build_tiny_model({str(tmp_path)!r}), {str(tmp_path / "out")!r}, max_steps=1)
        w = rt.watch(trainer, run="mine", guard=(rt.stop_on_critical,))
        print(json.dumps(dict(run=w.run, guard=[g.__name__ for g in w.watch_config.guard])))
        trainer.train()
    """))
    result = rlwatch_run(sys.executable, str(script), extra=("--port", "0"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith('{"run": ')]
    info = json.loads(line)
    assert info == {"run": "mine", "guard": ["stop_on_critical"]}
    assert "replaces the Watch that `rlwatch run` attached when the trainer was built: run 'out' -> 'mine'" \
        in result.stderr
    assert "rlwatch run: watched trl run 'mine'" in result.stderr
    assert "watched trl run 'out'" not in result.stderr
    from rlwatch.runs.store import StoreReader

    with StoreReader(str(tmp_path / "out" / "rlwatch.db")) as store:
        assert store.runs()[-1] == "mine" and [r.step for r in store.steps("mine")] == [1]
