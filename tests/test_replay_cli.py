"""``rlwatch replay`` on the command line: the table and the post-mortem, ``--json``, several files,
``--reward`` and ``--override``; a file it cannot read is one line on stderr and exit status 2."""

from __future__ import annotations

import json

import pytest

from rlwatch.ops.cli import main

from ._replay_helpers import DROP, collapsed_rows, write_trl, write_wandb_csv


@pytest.fixture
def collapsed(tmp_path):
    return write_trl(tmp_path / "trainer_state.json", collapsed_rows())


def test_text_names_the_collapse_against_the_reward_curve(collapsed, capsys):
    assert main(["replay", str(collapsed)]) == 0
    out = capsys.readouterr().out
    assert f"COLLAPSE at {DROP}" in out and "reward peak 0.8 at 30" in out
    assert f"collapse: step {DROP};" in out
    assert f"reward collapsed at step {DROP}" in out            # the post-mortem's headline follows


def test_json_is_the_postmortem_document_with_the_replay(collapsed, capsys, tmp_path):
    assert main(["replay", str(collapsed), "--json", "--out", str(tmp_path / "stores")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["collapse_step"] == DROP and doc["quality_signal"] == "reward"
    assert doc["replay"]["collapse_step"] == DROP and doc["replay"]["log_every"] == 1
    assert doc["replay"]["recognised"] == {"reward": "reward_mean", "entropy": "entropy_mean", "loss": "loss"}
    assert doc["replay"]["store"].startswith(str(tmp_path / "stores"))
    assert (tmp_path / "stores" / "replay-trainer_state.db").exists()


def test_several_files_are_several_runs(collapsed, tmp_path, capsys):
    healthy = write_wandb_csv(tmp_path / "healthy.csv",
                              [(s, {**v, "reward": 0.5}) for s, v in collapsed_rows()])
    assert main(["replay", str(collapsed), str(healthy), "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["collapse_step"] for d in docs] == [DROP, None]
    assert [d["replay"]["format"] for d in docs] == ["trl", "csv"]


def test_reward_names_a_column_that_is_not_a_recognised_name(tmp_path, capsys):
    path = write_trl(tmp_path / "trainer_state.json", collapsed_rows(reward_key="my_score"))
    assert main(["replay", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["collapse_step"] is None        # no reward it knows
    assert main(["replay", str(path), "--json", "--reward", "my_score"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["collapse_step"] == DROP and doc["replay"]["reward_key"] == "my_score"


def _one_line_exit_2(argv, capsys, expect):
    assert main(["replay", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expect in err, err
    return err


@pytest.mark.parametrize("content, expect", [
    ("", "empty"),
    ("   \n\n", "empty"),
    ('{"log_history": [', "not valid JSON"),
    ('{"global_step": 3}', "no logged step found"),
    ("[1, 2, 3]", "not a format replay reads"),
    ("hello world\nnothing here\n", "not a format replay reads"),
    ("Step,reward\nabc,def\n", "no logged step found"),
    ('{"step": 1, "data": {"reward": 1}}\nnot json\n', "line 2 is not JSON"),
    ("\0\1\2binary", "a binary file"),
])
def test_a_file_replay_cannot_read_is_one_line_and_exit_2(tmp_path, capsys, content, expect):
    path = tmp_path / "log.txt"
    path.write_text(content)
    _one_line_exit_2([str(path)], capsys, expect)


def test_missing_file_directory_unknown_key_and_bad_options(tmp_path, collapsed, capsys):
    _one_line_exit_2([str(tmp_path / "nope.json")], capsys, "not found")
    (tmp_path / "empty_dir").mkdir()
    _one_line_exit_2([str(tmp_path / "empty_dir")], capsys, "a directory")
    _one_line_exit_2([str(collapsed), "--reward", "no_such_key"], capsys, "no key 'no_such_key'")
    _one_line_exit_2([str(collapsed), "--override", "no_such_param=1"], capsys, "no_such_param")
    _one_line_exit_2([str(collapsed), "--override", "oops"], capsys, "NAME=NUMBER")
    _one_line_exit_2([str(collapsed), "--format", "verl-jsonl"], capsys, "not JSON")


def test_a_bad_file_among_good_ones_still_replays_the_good(tmp_path, collapsed, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("")
    assert main(["replay", str(bad), str(collapsed), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and json.loads(captured.out)[0]["collapse_step"] == DROP


def test_override_changes_a_threshold_for_the_replay(tmp_path, capsys):
    """The logged entropy falls to a tenth: at the shipped ratio (0.2) the entropy alert fires; with
    ``--override entropy_collapse_ratio=0.05`` (a fall to a twentieth) it does not."""
    rows = [(s, {**v, "entropy": 1.0 if s < 30 else 0.1}) for s, v in collapsed_rows()]
    path = write_trl(tmp_path / "trainer_state.json", rows)

    def fired(*extra: str) -> set[str]:
        assert main(["replay", str(path), "--json", *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        return {a["name"] for a in doc["replay"]["alerts"] if a["state"] == "fired"}

    assert "RLWatchEntropyCollapse" in fired()
    assert "RLWatchEntropyCollapse" not in fired("--override", "entropy_collapse_ratio=0.05")
