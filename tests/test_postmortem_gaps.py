"""A store that lost steps (a full disk, a full queue, a killed writer): the post-mortem says how many
steps are missing and where, in the text, the markdown and the JSON; a run observed every k steps, or
with every step stored, has none."""

from __future__ import annotations

import json

from rlwatch.ops.cli import main
from rlwatch.postmortem import analyse, load
from rlwatch.runs.store import RunStore

#: 150 of 300 steps lost: three holes and the last 13 steps (known from the store's note on step 299).
HOLES = [(20, 69), (100, 149), (200, 236), (287, 299)]


def write_store(path, steps: range, lost: list[tuple[int, int]], note_step: int | None = None) -> None:
    """A run ``gappy`` with every step of ``steps`` stored but those in ``lost``; a ``store_row_dropped``
    note on ``note_step`` as the store writes one for a step the database refused."""
    store = RunStore(str(path))
    store.submit_run("gappy", {"framework": "custom"})
    for step in steps:
        if not any(a <= step <= b for a, b in lost):
            store.submit_step("gappy", step, {"reward_mean": {(): 0.5 + 0.001 * (step % 7)},
                                              "mismatch_kl_k3": {(): 1e-3}})
    if note_step is not None:
        store.submit_event("gappy", "store_row_dropped", f"step {note_step} could not be written: "
                                                         "OperationalError: database or disk is full")
    assert store.flush()
    store.close()


def test_a_store_that_lost_half_its_steps_says_how_many_and_where(tmp_path, capsys):
    write_store(tmp_path / "run.db", range(300), HOLES, note_step=299)
    assert main(["postmortem", str(tmp_path / "run.db"), "--out", str(tmp_path / "report")]) == 0
    out = " ".join(capsys.readouterr().out.split())          # the terminal's report, unwrapped
    assert "steps 0..286" in out
    assert "missing steps: 150 of the 300 steps 0..299 are not in the store: 20..69, 100..149, 200..236, " \
           "287..299" in out
    assert "150 of the 300 steps" in (tmp_path / "report" / "postmortem.md").read_text()
    doc = json.loads((tmp_path / "report" / "postmortem.json").read_text())
    assert doc["missing_steps"]["count"] == 150 and doc["missing_steps"]["expected"] == 300
    assert doc["missing_steps"]["ranges"] == [list(h) for h in HOLES]


def test_a_run_observed_every_fifth_step_misses_only_its_own_steps(tmp_path):
    write_store(tmp_path / "every5.db", range(0, 500, 5), [])
    assert analyse(load(str(tmp_path / "every5.db"))).missing_steps is None
    write_store(tmp_path / "holed.db", range(0, 500, 5), [(100, 149)])
    missing = analyse(load(str(tmp_path / "holed.db"))).missing_steps
    assert (missing.count, missing.expected, missing.spacing, missing.ranges) == (10, 100, 5, [(100, 145)])
    assert "(one every 5)" in missing.text()


def test_a_complete_store_reports_no_missing_steps(tmp_path, capsys):
    write_store(tmp_path / "whole.db", range(120), [])
    assert main(["postmortem", str(tmp_path / "whole.db"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_steps"] is None
