"""``rlwatch replay`` on SwanLab chart exports: the real ones of the corpus (065536/Asycn_verl's ``exp_data/``,
written by SwanLab: one metric for several runs a file, a ``step`` column then ``<run>-<key>_step`` per run),
copied as they are; no value in this file is made up."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from evaluation.realruns import corpus
from rlwatch.ops.cli import main
from rlwatch.replay import ReplayInputError, load, load_all
from rlwatch.replay.formats import detect

#: The synchronous entropy-bonus run its authors call a "catastrophic entropy explosion" (entropy 0.68 at the
#: start, 4.97 by step 15, 11.7 by step 25, saturated from step 30; exp_data/4.7/ANALYSIS.md Finding 1).
COLLAPSED = "asycn-verl-sync-ent0.01-lr1e-5"
SWANLAB = [e for e in corpus.runs() if e.format == "swanlab_csv"]


def _entry(run_id: str) -> corpus.CorpusRun:
    return next(e for e in SWANLAB if e.id == run_id)


def _copies(entry: corpus.CorpusRun, into: Path) -> list[str]:
    """The entry's exports copied into ``into`` (one folder a panel, as in the source), byte for byte."""
    out = []
    for path in entry.paths():
        target = into / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        out.append(str(target))
    return out


def _folder(entry: corpus.CorpusRun) -> str:
    """The date folder of ``entry``'s exports (``exp_data/<date>/<panel>/*.csv``)."""
    return entry.paths()[0].parent.parent.name


def _folder_runs(folder: str) -> set[str]:
    """The manifest's runs read from the exports of ``folder``."""
    return {e.column_prefix for e in SWANLAB if _folder(e) == folder}


def test_every_swanlab_export_of_the_corpus_is_detected_as_swanlab():
    paths = sorted({p for e in SWANLAB for p in e.paths()})
    assert len(paths) > 40
    for path in paths:
        assert detect(path.read_text(encoding="utf-8"), str(path)) == "swanlab", path
    # A W&B-style export with a plain step column is not one
    assert detect("step,actor/entropy,critic/score/mean\n1,0.6,0.2\n", "w.csv") == "csv"
    assert detect("Step,my-run - reward,my-run - reward__MIN\n1,0.2,0.1\n", "w.csv") == "csv"


def test_a_collapsed_asycn_verl_run_replays_and_names_what_fired(tmp_path, capsys):
    entry = _entry(COLLAPSED)
    files = _copies(entry, tmp_path / "exports")
    assert main(["replay", *files, "--run", entry.column_prefix, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    replay = doc["replay"]
    assert replay["format"] == "swanlab" and entry.column_prefix in replay["source"]
    assert replay["reward_key"] == "critic/score/mean"
    assert replay["store"].endswith(f"/replay-{entry.column_prefix}.db")  # the run's whole name, dots included
    assert replay["recognised"]["actor/entropy"] == "entropy_mean"
    fired = {a["name"]: a["step"] for a in replay["alerts"] if a["state"] == "fired"}
    assert fired, "nothing fired on a run whose entropy exploded"
    # entropy 11.7 by step 25, saturated from step 30: rlwatch's entropy alert fires by then
    assert fired["RLWatchEntropySurge"] <= 30
    assert main(["replay", *files, "--run", entry.column_prefix]) == 0
    text = capsys.readouterr().out
    assert "(swanlab)" in text and "RLWatchEntropySurge fired at" in text


def test_several_runs_and_no_run_named_is_one_line_listing_them_exit_2(tmp_path, capsys):
    entry = _entry(COLLAPSED)
    files = _copies(entry, tmp_path / "exports")
    assert main(["replay", *files]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    [line] = captured.err.strip().splitlines()
    assert "--run NAME" in line
    listed = set(line.rsplit(": ", 1)[1].split(", "))
    assert listed == _folder_runs(_folder(entry))

    assert main(["replay", *files, "--run", "deepseek1.5b_no_such_run"]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert "'deepseek1.5b_no_such_run'" in line and entry.column_prefix in line and "Traceback" not in line
    with pytest.raises(ReplayInputError, match="--run NAME"):
        load(files[0])                      # one export of several runs, no run named


@pytest.mark.parametrize("run_id", [COLLAPSED, "asycn-verl-sync-lr1e-5-baseline"])
def test_a_runs_values_are_the_exports_cells_and_the_corpus_loaders(run_id):
    entry = _entry(run_id)
    [run] = load_all([str(p) for p in entry.paths()], run=entry.column_prefix, reward_key=entry.reward_key)
    assert not isinstance(run, ReplayInputError)
    by_step = dict(zip(run.steps, run.rows))
    cells_read = 0
    for path in entry.paths():
        with path.open(encoding="utf-8", newline="") as handle:
            header, *records = list(csv.reader(handle))
        for i, column in enumerate(header):
            if column.startswith(entry.column_prefix + "-") and column.endswith("_step"):
                key = column[len(entry.column_prefix) + 1:-len("_step")]
                cells = {int(r[0]): float(r[i]) for r in records if i < len(r) and r[i] != ""}
                assert {s: by_step[s][key] for s in cells} == cells, key
                cells_read += len(cells)
    assert cells_read == sum(len(row) for row in run.rows) + sum(len(s) for s in run.nonfinite.values())
    assert all(not k.startswith("deepseek") for row in run.rows for k in row)
    loaded = corpus.load_run(entry)
    assert (loaded.steps, loaded.rows, loaded.reward_key) == (run.steps, run.rows, run.reward_key)


def test_the_runs_found_in_each_folders_exports_are_the_manifests_runs():
    from rlwatch.replay.formats import swanlab_runs

    for folder in sorted({_folder(e) for e in SWANLAB}):
        paths = sorted({p for e in SWANLAB if _folder(e) == folder for p in e.paths()})
        columns = [[h[:-len("_step")] for h in p.read_text(encoding="utf-8").split("\n", 1)[0].split(",")[1:]]
                   for p in paths]
        assert swanlab_runs(columns) == sorted(_folder_runs(folder)), folder


def test_an_export_of_one_run_joins_that_run():
    """``actor/entropy_loss`` was exported for the async entropy-bonus run alone (one column): its key is read
    whole, and the exports' runs are still the others' names, not a half of that column."""
    entry = _entry("asycn-verl-async-ent0.01-lr1e-5")
    [lone] = [p for p in entry.paths() if p.read_text(encoding="utf-8").split("\n", 1)[0].count(",") == 1]
    column = lone.read_text(encoding="utf-8").split("\n", 1)[0].split(",")[1]
    assert column == entry.column_prefix + "-actor/entropy_loss_step"
    [run] = load_all([str(lone), *(str(p) for p in entry.paths() if p != lone)], run=entry.column_prefix)
    assert not isinstance(run, ReplayInputError) and "actor/entropy_loss" in run.keys
    [listing] = load_all([str(p) for p in entry.paths()])
    assert isinstance(listing, ReplayInputError) and "--run NAME" in str(listing)
    assert entry.column_prefix + "," in str(listing) + "," and "actor/entropy_loss" not in str(listing)


def test_a_collapse_dated_on_the_held_out_score_is_named_so_beside_the_reward_table(tmp_path, capsys):
    """The clip-0.1 run: its validation accuracy (every 10 steps) peaks at 0.30 at step 90 while the training
    reward, the table's column, stays below 0.09 there; the peak and the collapse carry the score's name."""
    entry = _entry("asycn-verl-sync-clip0.1-lr1e-5")
    files = _copies(entry, tmp_path / "exports")
    assert main(["replay", *files, "--run", entry.column_prefix]) == 0
    text = capsys.readouterr().out
    score = "val-core/AIME/acc/mean@16"
    assert f"  quality: {score}: the peak and the collapse are dated on it (the table shows the training reward)" \
        in text
    assert f"{score} peak 0.3016 at 90" in text and f"COLLAPSE of {score} at 260" in text
    assert "reward peak" not in text
