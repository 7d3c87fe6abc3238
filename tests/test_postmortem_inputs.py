"""Post-mortem hardening and honesty: crafted inputs end in one clear line (not-SQLite files,
malformed rows, a recursive view, a missing path), strings from a run never act as markup or
terminal escapes, the wording says what it does not know, the coverage section names what a
run could not measure, the --baseline comparison finds a planted divergence and nothing between
two seeds of one configuration, and --probe checks weights before building a model."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import rlwatch
from rlwatch.postmortem import PostmortemInputError, analyse, compare, load
from rlwatch.postmortem.changes import detect_change
from rlwatch.postmortem.report import markdown, safe, terminal

from tests.conftest import make_step

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`rlwatch postmortem ARGS` as a user runs it, in its own process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "rlwatch", "postmortem", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture
def inproc(capsys):
    """The same command line in this process (no interpreter start-up per call)."""
    from rlwatch.ops.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        rc = main(["postmortem", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out, err)
    return run


def synthetic_run(path: str, seed: int, steps: int = 60, planted: int | None = None, run: str = "syn",
                  logprobs: bool = True) -> None:
    """A steady run; from ``planted`` on, the sampler-learner mismatch is five times larger."""
    with rlwatch.Watch(run=run, port=None, store=path) as w:
        for step in range(steps):
            bad = planted is not None and step >= planted
            rec = make_step(B=16, T=16, seed=seed * 1000 + step, lag_max=0, noise=0.1 if bad else 0.02)
            if not logprobs:
                rec.pop("sampler_logp")
                rec.pop("token_version")
            w.observe(step, **rec)
            if step % 10 == 9:
                w.record_checkpoint(step, f"/ckpt/checkpoint-{step}")


@pytest.fixture(scope="module")
def steady_store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("steady") / "run.db")
    synthetic_run(path, seed=1)
    return path


# --- inputs that are not what they claim ---------------------------------------------------------

def test_missing_path_says_not_found(tmp_path, inproc):
    result = cli(str(tmp_path / "nope.db"))
    assert result.returncode == 1 and "not found" in result.stderr and "Traceback" not in result.stderr
    result = inproc(str(tmp_path / "run.db"), "--baseline", str(tmp_path / "good.db"))
    assert result.returncode == 1 and "not found" in result.stderr


def test_a_file_that_is_not_sqlite_is_refused_in_one_line(tmp_path, inproc):
    for name, content in (("text.db", b"hello, I am not a database\n" * 10), ("empty.db", b""),
                          ("truncated.db", b"SQLite format 3\x00" + b"\x00" * 50)):
        path = tmp_path / name
        path.write_bytes(content)
        result = inproc(str(path))
        assert result.returncode == 1, (name, result.stdout)
        assert "Traceback" not in result.stderr and "rlwatch postmortem:" in result.stderr, (name, result.stderr)
        assert "store" in result.stderr or "database" in result.stderr


def test_malformed_rows_cost_those_rows_only(tmp_path, steady_store, inproc):
    path = tmp_path / "run.db"
    path.write_bytes(Path(steady_store).read_bytes())
    conn = sqlite3.connect(path)
    conn.executemany("UPDATE steps SET data = ? WHERE step = ?", [
        ("{not json", 3), ("[1, 2]", 4), ('{"reward_mean": 5}', 5), ('{"reward_mean": [["x", "y", "str"]]}', 6),
        ("[" * 100000 + "]" * 100000, 7), (None, 8)])
    conn.execute("INSERT INTO alerts (run, step, name, severity, state, labels) VALUES ('syn', 'x', 'A', 'c', "
                 "'firing', '{broken')")
    conn.execute("INSERT INTO checkpoints (run, step, path, time) VALUES ('syn', 'abc', '/x', 0)")
    conn.execute("INSERT INTO scalars VALUES ('syn', 1, 'heldout_true_reward', 'not a number')")
    conn.commit()
    conn.close()
    data = load(str(path))
    assert {s for s, _ in data.steps} == set(range(60)) - {3, 4, 7, 8}     # 5 and 6: rows without a usable value
    assert data.series("reward_mean") and all(s not in (5, 6) for s, _ in data.series("reward_mean"))
    notes = [e["detail"] for e in data.events if e["kind"] == "unreadable"]
    assert "4 malformed step rows skipped" in notes and any("alert" in n for n in notes), notes
    result = inproc(str(path), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert any("malformed" in n for n in doc["coverage"]["notes"])


def test_a_recursive_view_is_refused_not_run(tmp_path):
    path = tmp_path / "view.db"
    conn = sqlite3.connect(path)
    conn.executescript(textwrap.dedent("""
        CREATE TABLE runs (run TEXT PRIMARY KEY, started REAL, meta TEXT);
        INSERT INTO runs VALUES ('r', 0, '{}');
        CREATE VIEW steps AS WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n)
            SELECT 'r' AS run, i AS step, 0.0 AS time, '{}' AS data FROM n;
    """))
    conn.close()
    start = time.monotonic()
    result = cli(str(path), timeout=60)           # its own process: a hang would be killed by the timeout
    assert result.returncode == 1 and "steps is a view" in result.stderr, result.stderr
    assert time.monotonic() - start < 30


def test_a_query_that_runs_too_long_is_stopped(tmp_path, monkeypatch, steady_store):
    """The backstop under the table checks: a read past its deadline stops with a clear error."""
    from rlwatch.postmortem import sources

    monkeypatch.setattr(sources, "READ_DEADLINE_S", -1.0)
    monkeypatch.setattr(sources, "PROGRESS_EVERY", 1)
    with pytest.raises(PostmortemInputError, match="stopped"):
        load(steady_store)


def test_a_malformed_trainer_state_is_one_line(tmp_path, inproc):
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text("{oops")
    result = inproc(str(tmp_path))
    assert result.returncode == 1 and "trainer state" in result.stderr and "Traceback" not in result.stderr


def test_an_unreachable_prometheus_is_one_line(inproc):
    from tests.conftest import free_port

    result = inproc("--prometheus", f"http://127.0.0.1:{free_port()}", "--run", "x")
    assert result.returncode == 1 and "cannot query Prometheus" in result.stderr


# --- strings from a run are data, never markup or escape sequences ------------------------------------

HOSTILE = ["math[/bold]", "[link=https://evil.example]click[/link]", "\x1b]52;c;ZXZpbA==\x07clip",
           "\x1b[2J\x1b[31mred", "bad\udcff", "rtl\u202eevil", "$\\frac{1}{0}$ | `x` <b>"]


def hostile_store(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "hostile.db"
    path.write_bytes(Path(source).read_bytes())
    conn = sqlite3.connect(path)
    for i, text in enumerate(HOSTILE):
        raw = text.encode("utf-8", "surrogateescape")           # lone surrogate -> invalid UTF-8 in the file
        labels = json.dumps({"env": text, "detector": text}, ensure_ascii=False).encode("utf-8", "surrogateescape")
        conn.execute("INSERT INTO alerts (run, step, time, name, severity, state, labels) VALUES (?, ?, 0, "
                     "CAST(? AS TEXT), CAST(? AS TEXT), 'firing', CAST(? AS TEXT))",
                     ("syn", i, raw, b"critical" if i % 2 else raw, labels))
        conn.execute("INSERT INTO checkpoints (run, step, path, time) VALUES ('syn', ?, CAST(? AS TEXT), 0)",
                     (i, b"/ckpt/" + raw))
        conn.execute("INSERT INTO events (run, time, kind, detail) VALUES ('syn', 0, CAST(? AS TEXT), "
                     "CAST(? AS TEXT))", (raw, raw))
    conn.commit()
    conn.close()
    return path


def test_run_strings_are_escaped_everywhere(tmp_path, steady_store):
    path = hostile_store(tmp_path, steady_store)
    result = cli(str(path), "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b" not in out and "\u202e" not in out            # no escape sequence or override reaches the terminal
    assert "math[/bold]" in out and "[link=https://evil.example]" in out
    assert "\\x1b]52;c;" in out and "\\u202e" in out and "bad\\udcff" in out
    # rich on a real terminal: its own colours only, no link (OSC 8) and no clipboard write (OSC 52)
    report = analyse(load(str(path)))
    from rich.console import Console

    buffer = io.StringIO()
    terminal(report, Console(file=buffer, force_terminal=True, width=200))
    rendered = buffer.getvalue()
    assert "\x1b]" not in rendered and "\x1b[2J" not in rendered and "math[/bold]" in rendered
    text = (tmp_path / "report" / "postmortem.md").read_text()
    assert "\x1b" not in text and "\\[link=https://evil.example\\]" in text and "<b>" not in text
    assert json.loads((tmp_path / "report" / "postmortem.json").read_text())["alerts"]


def test_safe_shows_every_control_character():
    assert safe("a\x00b\x07c\x1b[0m\x9b\u2028\udcff") == "a\\x00b\\x07c\\x1b[0m\\x9b\\u2028\\udcff"
    assert safe("plain ünïcode 数学 text") == "plain ünïcode 数学 text"


# --- honest wording ----------------------------------------------------------------------------------------

def test_no_cause_no_empty_tables_and_coverage_without_sampler_logprobs(tmp_path):
    """What a CPU TRL run without sampler log-probs leaves: no mismatch, no versions, no alerts."""
    path = str(tmp_path / "bare.db")
    synthetic_run(path, seed=2, steps=30, logprobs=False)
    report = analyse(load(path))
    assert report.cause == "no cause found"
    doc = report.as_json()
    assert doc["cause"] == "no cause found" and doc["cause_confidence"] is None
    missing = {m["family"]: m["why"] for m in doc["coverage"]["missing"]}
    assert "no sampler log-probs" in missing["sampler-learner mismatch"]
    assert "no versions" in missing["version lag (staleness)"]
    assert "zero-variance GRPO groups" in {c["family"] for c in doc["coverage"]["carried"]}
    buffer = io.StringIO()
    from rich.console import Console

    text = terminal(report, Console(file=buffer, width=200))
    assert "cause: no cause found" in text and "(high)" not in text and "none (" not in text
    assert "alerts: none fired" in text and "not carried: sampler-learner mismatch" in text
    md = markdown(report, [], tmp_path).read_text()
    assert "No cause found" in md and "| step | severity |" not in md and "None fired." in md
    assert "lead None" not in md and "-0 " not in md and "| None |" not in md


def test_cusum_dates_a_ramp_from_step_zero_and_ignores_single_groups():
    ramp = [(s, float(min(s, 8))) for s in range(60)]
    step, alarm, before, after, _ = detect_change(ramp, min_shift=1.0)
    assert step <= 2 and alarm <= 6 and after >= 7
    one_group = [(s, 1 / 32 if s in (7, 20, 41) else 0.0) for s in range(60)]
    assert detect_change(one_group, min_shift=0.05) is None
    shift = [(s, 0.0 if s < 30 else 0.2) for s in range(60)]
    assert detect_change(shift, min_shift=0.05)[0] == 30


# --- against a good run --------------------------------------------------------------------------------

@pytest.mark.parametrize("planted", [17, 33])
def test_comparison_finds_a_planted_divergence_within_two_steps(tmp_path, planted, steady_store):
    bad = str(tmp_path / "bad.db")
    synthetic_run(bad, seed=7, planted=planted)
    comparison = compare(load(bad), load(steady_store))
    assert comparison.divergences, comparison.compared
    first = comparison.divergences[0]
    assert abs(first.step - planted) <= 2 and first.signal.startswith(("mismatch_", "is_")), first
    assert all(abs(d.step - planted) <= 2 for d in comparison.divergences), comparison.divergences


def test_comparison_of_two_seeds_of_one_configuration_finds_nothing(tmp_path, steady_store):
    other = str(tmp_path / "other.db")
    synthetic_run(other, seed=3)
    comparison = compare(load(other), load(steady_store))
    assert comparison.common_steps == (0, 59, 60) and len(comparison.compared) >= 8
    assert comparison.divergences == []


def test_baseline_on_the_command_line(tmp_path, steady_store, inproc):
    bad = str(tmp_path / "bad.db")
    synthetic_run(bad, seed=7, planted=25)
    result = inproc(bad, "--baseline", steady_store, "--out", str(tmp_path / "report"), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert abs(doc["comparison"]["divergences"][0]["step"] - 25) <= 2
    assert any(Path(p).name.startswith("compare-") for p in doc["report"]["plots"])
    assert "## Against a good run" in (tmp_path / "report" / "postmortem.md").read_text()
    text = inproc(bad, "--baseline", steady_store).stdout
    assert "compared with syn" in text and "diverged: none" not in text
    same = inproc(steady_store, "--baseline", steady_store).stdout
    assert "diverged: none" in same


# --- --probe checks weights before building what config.json describes ---------------------------------

@pytest.mark.slow
def test_probe_refuses_weights_that_do_not_fit_the_config_before_allocating(tmp_path):
    pytest.importorskip("transformers")
    script = textwrap.dedent(f"""
        import json, resource, torch
        from pathlib import Path
        from safetensors.torch import save_file
        import transformers
        from rlwatch.postmortem.probe import load_policy
        d = Path({str(tmp_path / 'checkpoint-1')!r}); d.mkdir()
        json.dump({{"model_type": "qwen2", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
                   "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
                   "tie_word_embeddings": False}}, open(d / "config.json", "w"))
        save_file({{"model.embed_tokens.weight": torch.zeros(2, 2)}}, str(d / "model.safetensors"))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            load_policy(d)
            print("LOADED")
        except ValueError as exc:
            print("REFUSED", exc)
        print("GREW_MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert "REFUSED" in result.stdout and "config.json describes" in result.stdout, result.stdout + result.stderr
    grew = float(result.stdout.split("GREW_MB")[1])
    assert grew < 400, grew            # the model the config describes would take ~1,100 MB


def test_a_hacked_run_names_the_hack_not_a_confident_none():
    """The hack demo's shape: no mismatch at all, the buggy environment's hack rate rising."""
    from rlwatch.postmortem import RunData

    data = RunData(run="hack", source="memory")
    for step in range(40):
        rate = 0.02 if step < 10 else min(0.9, 0.05 * (step - 8))
        data.steps.append((step, {"env_hack_ratio": {("reverse", "verifier_disagreement"): rate,
                                                     ("copy", "verifier_disagreement"): 0.0},
                                  "mismatch_abs_log_ratio_mean": {(): 0.0}, "mismatch_log_ratio_mean": {(): 0.0},
                                  "reward_mean": {(): 0.5}}))
    report = analyse(data)
    doc = report.as_json()
    assert doc["cause"] == "reward_hacking" and doc["mismatch_diagnosis"] == "none"
    assert doc["evidence"][0].startswith("hack rate of reverse / verifier_disagreement rose")
    change = next(c for c in report.first_signals if c.signal == "env_hack_ratio")
    assert change.labels == ("reverse", "verifier_disagreement") and 9 <= change.step <= 12
    assert all(c.labels[0] != "copy" for c in report.first_signals if c.signal == "env_hack_ratio")
