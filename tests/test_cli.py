"""The `rlwatch` command as a new user meets it: help, version, option texts and defaults,
`rlwatch down` from another directory, what `rlwatch run` says, and the unrelated PyPI project
that shares the import name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlwatch
from rlwatch.ops.cli import build_parser

from tests.conftest import ROOT, free_port, need_binary


def cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120
        ) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "rlwatch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=full)


def test_bare_command_prints_help_and_version_names_the_distribution():
    bare = cli()
    assert bare.returncode == 0 and "usage: rlwatch" in bare.stdout and "demo" in bare.stdout
    assert "required" not in bare.stderr
    version = cli("--version")
    assert version.returncode == 0
    assert version.stdout.strip().startswith(f"rlwatch-llm {rlwatch.__version__} (import name rlwatch, ")


def test_every_option_of_up_down_demo_run_has_help_and_shows_its_default():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in ("up", "down", "demo", "run"):
        formatter = commands[name]._get_formatter()
        for action in commands[name]._actions:
            if not action.option_strings or action.dest == "help":
                continue
            option = f"rlwatch {name} {action.option_strings[0]}"
            assert action.help, f"{option} has no help text"
            if action.default is not None and action.default is not False:
                assert "default" in formatter._get_help_string(action), f"{option} does not show its default"
    assert "(default: 9090)" in commands["up"].format_help().replace("\n", " ").replace("  ", " ")


def test_rlwatch_run_says_when_nothing_was_instrumented_and_store_none_means_no_store(tmp_path):
    probe = ("import json, rlwatch.ops.autoload as a; "
             "print(json.dumps(a.watch_options_from_env()))")
    result = cli("run", "--store", "none", "--port", "0", "--", sys.executable, "-c", probe, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    options = json.loads(result.stdout.strip().splitlines()[-1])
    assert options["store"] is None                                  # no store, not a file named "none"
    assert "rlwatch run: watching supported trainers" in result.stderr
    assert "rlwatch run: nothing was instrumented: no process of the command imported a supported framework" \
        in result.stderr
    assert not list(tmp_path.iterdir())
    quiet = cli("run", "--quiet", "--", sys.executable, "-c", "print('hi')", cwd=tmp_path)
    assert quiet.stdout.strip() == "hi" and "rlwatch run" not in quiet.stderr


def test_rlwatch_run_lists_the_watch_a_custom_loop_creates_instead_of_nothing_instrumented(tmp_path):
    """examples/custom_loop.py builds its own rlwatch.Watch: `rlwatch run` says where it exported,
    never "nothing was instrumented ... create an rlwatch.Watch"."""
    store = tmp_path / "loop.db"
    result = cli("run", "--", sys.executable, str(ROOT / "examples" / "custom_loop.py"), "--steps", "2", "--pace",
                 "0", "--port", "0", "--store", str(store), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing was instrumented" not in result.stderr and "create an rlwatch.Watch" not in result.stderr
    assert ("rlwatch run: the command's own rlwatch.Watch watched run 'custom-loop' (process "
            in result.stderr), result.stderr[-2000:]
    assert f"store {store} (rlwatch postmortem {store})" in result.stderr and "metrics were at http://" in result.stderr


def test_rlwatch_run_names_the_framework_it_saw_imported(tmp_path):
    """A program that imports a supported framework but builds no trainer: the summary says so."""
    pytest.importorskip("trl")
    result = cli("run", "--", sys.executable, "-c", "import trl", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing was instrumented: it imported trl" in result.stderr


def test_rlwatch_run_reports_the_watch_a_ray_actor_integration_creates(tmp_path):
    """verl/OpenRLHF create their Watch inside the trainer actor on its first step; `rlwatch run`
    announces it there and lists it at the end (here the first step is the instrumentor's own call)."""
    pytest.importorskip("verl")
    script = ("from rlwatch.integrations import verl; w = verl.INSTRUMENTOR._get_watch(None); "
              "print(w.url); w.close()")
    result = cli("run", "--run", "actor-run", "--port", "0", "--store", str(tmp_path / "s.db"), "--",
                 sys.executable, "-c", script, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    url = result.stdout.strip().splitlines()[-1]
    assert f"rlwatch: watching verl run 'actor-run': metrics {url}, store {tmp_path / 's.db'}" in result.stderr
    assert "rlwatch run: watched verl run 'actor-run'" in result.stderr
    assert "nothing was instrumented" not in result.stderr


@pytest.mark.servers
def test_down_finds_the_stack_from_another_directory(tmp_path):
    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    env = {"RLWATCH_STATE_DIR": str(tmp_path / "state")}
    stacks = {}
    try:
        for name in ("a", "b"):
            directory = tmp_path / name / "stack"
            directory.parent.mkdir()
            up = cli("up", "--dir", "stack", "--prometheus-port", str(free_port()), "--alertmanager-port",
                     str(free_port()), "--runbook-port", str(free_port()), "--target", "127.0.0.1:1",
                     cwd=directory.parent, env=env)
            assert up.returncode == 0, up.stdout + up.stderr
            stacks[name] = directory
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        both = cli("down", cwd=elsewhere, env=env)
        assert both.returncode == 1                                      # which one? never a silent guess
        assert all(f"rlwatch down --dir {d}" in both.stderr for d in stacks.values())
        wrong = cli("down", "--dir", str(elsewhere), cwd=elsewhere, env=env)
        assert wrong.returncode == 1 and "nothing was running from" in wrong.stderr and str(stacks["a"]) in wrong.stderr
        pids = [i["pid"] for i in json.loads((stacks["a"] / "pids.json").read_text()).values()]
        first = cli("down", "--dir", str(stacks["a"]), cwd=elsewhere, env=env)
        assert first.returncode == 0 and "prometheus" in first.stdout
        last = cli("down", cwd=elsewhere, env=env)                       # the only one left
        assert last.returncode == 0 and f"(stack in {stacks['b']})" in last.stdout
        time.sleep(0.3)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        none = cli("down", cwd=elsewhere, env=env)
        assert none.returncode == 0 and "nothing was running" in none.stdout
        assert not list((tmp_path / "state" / "stacks").glob("*.json"))
    finally:
        from rlwatch.runs.stack import down

        for directory in stacks.values():
            down(directory)


def test_the_unrelated_rlwatch_project_is_detected(tmp_path):
    """Installed side by side, the other project's files land in rlwatch/ and its metadata says
    Name: rlwatch; import, the CLI and `rlwatch run` say what happened and how to fix it."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "rlwatch", site / "rlwatch", ignore=shutil.ignore_patterns("__pycache__", "_data"))
    (site / "rlwatch" / "detectors.py").write_text("# the other project's module\n")
    info = site / "rlwatch-0.5.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: rlwatch\nVersion: 0.5.1\n"
                                   "Summary: Real-time GRPO/PPO training instability detection for ML teams\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    imported = subprocess.run([sys.executable, "-c", "import rlwatch"], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=60)
    assert imported.returncode == 0
    assert "rlwatch 0.5.1 is installed in this environment as well as rlwatch-llm" in imported.stderr
    assert "pip uninstall -y rlwatch rlwatch-llm && pip install rlwatch-llm" in imported.stderr
    files = subprocess.run([sys.executable, "-m", "rlwatch", "files"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=60)
    assert "warning: rlwatch 0.5.1 is installed" in files.stderr
    clean = cli("files")
    assert clean.returncode == 0 and "warning" not in clean.stderr and "runbook" in clean.stdout


def test_down_signals_only_the_processes_up_started(tmp_path):
    """A PID written into pids.json by anyone (or reused since) is never signalled: `down` checks the
    executable and start time recorded at `up`, and never touches PID <= 1."""
    from rlwatch.runs import procinfo
    from rlwatch.runs.stack import running

    foreign = subprocess.Popen(["sleep", "300"])
    try:
        directory = tmp_path / "stack"
        directory.mkdir()
        me = procinfo.identity(foreign.pid)
        (directory / "pids.json").write_text(json.dumps({
            "prometheus": {"pid": foreign.pid, "url": "http://127.0.0.1:1"},                 # no identity
            "alertmanager": {"pid": foreign.pid, "exe": "/usr/bin/prometheus-alertmanager",   # another program
                             "start": me["start"]},
            "grafana": {"pid": foreign.pid, "exe": me["exe"], "start": me["start"] + "1"},    # PID reused since
            "everything": {"pid": 0}}))
        assert running(directory) == {}
        # In a session of its own: were PID 0 signalled, only the `down` command itself would die.
        result = subprocess.run([sys.executable, "-m", "rlwatch", "down", "--dir", str(directory)],
                                capture_output=True, text=True, timeout=60, start_new_session=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert result.returncode == 0, result.stderr
        time.sleep(0.3)
        assert foreign.poll() is None, "rlwatch down killed a process it did not start"
        assert f"left process {foreign.pid} alone" in result.stderr and "Traceback" not in result.stderr
        # Whatever an entry claims, PIDs -1, 0 and 1 never count as running (so are never signalled).
        (directory / "pids.json").write_text(json.dumps(
            {name: {"pid": pid, **(procinfo.identity(max(pid, 1)) or {"exe": "/sbin/init", "start": "1"})}
             for name, pid in (("all", -1), ("group", 0), ("init", 1))}))
        assert running(directory) == {}
    finally:
        foreign.kill()
        foreign.wait(timeout=10)


def test_cli_errors_are_one_line_without_a_traceback(tmp_path):
    not_a_program = cli("run", "--", str(tmp_path))                          # a directory: PermissionError
    assert not_a_program.returncode == 126
    assert not_a_program.stderr.strip().splitlines()[-1] == f"rlwatch run: cannot run {tmp_path}: Permission denied"
    assert "Traceback" not in not_a_program.stderr
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    onto_a_file = cli("files", "--copy", str(a_file))
    assert onto_a_file.returncode == 1 and "Traceback" not in onto_a_file.stderr
    assert onto_a_file.stderr.startswith(f"rlwatch files: cannot copy into {a_file}: ")
    assert len(onto_a_file.stderr.strip().splitlines()) == 1 and a_file.read_text() == "mine\n"
    if os.geteuid() == 0:           # root writes into a mode 0555 directory: take a read-only filesystem
        read_only = Path("/sys/rlwatch-files")
    else:
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o555)
    into_read_only = cli("files", "--copy", str(read_only))
    assert into_read_only.returncode == 1 and "Traceback" not in into_read_only.stderr
    assert into_read_only.stderr.startswith(f"rlwatch files: cannot copy into {read_only}: ")
    assert len(into_read_only.stderr.strip().splitlines()) == 1


def test_files_copy_keeps_a_user_edited_rule_file_unless_forced(tmp_path):
    assert cli("files", "--copy", str(tmp_path)).returncode == 0
    rules = tmp_path / "alerts" / "rlwatch-rules.yaml"
    shipped = rules.read_text()
    assert cli("files", "--copy", str(tmp_path)).returncode == 0               # unchanged files: copied again
    rules.write_text(shipped + "# our team's edit\n")
    refused = cli("files", "--copy", str(tmp_path))
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert refused.stderr.startswith(f"rlwatch files: {rules} differs from the shipped copy")
    assert "--force" in refused.stderr
    assert rules.read_text().endswith("# our team's edit\n")
    forced = cli("files", "--copy", str(tmp_path), "--force")
    assert forced.returncode == 0 and rules.read_text() == shipped


def test_rlwatch_run_says_when_the_commands_python_cannot_import_rlwatch(tmp_path):
    """The command's Python is another environment (here a fresh venv without rlwatch): the summary says
    so instead of "nothing was instrumented: no process imported a supported framework"."""
    venv = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    other = venv / "bin" / "python"
    launcher = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from rlwatch.ops.cli import main; sys.exit(main())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", launcher, "run", "--", str(other), "-c", "print('trained')"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "trained", result.stderr
    assert (f"rlwatch run: nothing was instrumented: the command's Python ({other}) cannot import rlwatch "
            f"(ModuleNotFoundError: No module named 'rlwatch')") in result.stderr, result.stderr


def test_the_demo_says_how_to_reach_the_rlwatch_command(tmp_path):
    from rlwatch.demo.app import next_steps

    scripts = Path(sys.executable).parent
    if not (scripts / "rlwatch").exists():
        pytest.skip("no rlwatch script beside this Python (not an installed environment)")
    elsewhere = next_steps(path=str(tmp_path))                          # a PATH without the environment
    assert "`rlwatch` is not on your PATH: first run `source" in elsewhere or f"export PATH={scripts}" in elsewhere
    assert "`rlwatch up`" in elsewhere and "rlwatch run -- python your_script.py" in elsewhere
    assert "not on your PATH" not in next_steps(path=f"{tmp_path}{os.pathsep}{scripts}")
    readme = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in readme
