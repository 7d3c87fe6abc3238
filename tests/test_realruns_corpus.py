"""The public real-run corpus (evaluation/realruns): every run's files exist and are modest, every run
cites its source and has a split, the splits are disjoint by source, the collapse statements are
well formed, the frameworks' key names the files map to are ones rlwatch recognises, and the harness
replays a run end to end (python -m evaluation.realruns on a one-run manifest)."""

from __future__ import annotations

import json
import re
import pytest

from evaluation.realruns import corpus, runs, score_run, summarise
from evaluation.realruns.__main__ import main
from rlwatch.core.trainer_keys import recognise

DOC = corpus.read_manifest()
ENTRIES = DOC["runs"]
SMALL = "verl-commeff-ef-r1"        # 42 logged steps: the smallest collapsed run


def test_every_run_has_files_a_citation_and_a_split():
    assert len(ENTRIES) >= 6
    ids = [e["id"] for e in ENTRIES]
    assert len(ids) == len(set(ids)), "run ids repeat"
    for e in ENTRIES:
        assert e["split"] in corpus.SPLITS, e["id"]
        assert e["outcome"] in corpus.OUTCOMES, e["id"]
        assert e["source"] in DOC["sources"], f"{e['id']}: source {e['source']!r} is not described"
        cited = e.get("source_path") and re.fullmatch(r"[0-9a-f]{40}", e.get("source_commit", ""))
        assert e.get("source_url") or cited, f"{e['id']}: no repository path + commit or URL"
        assert e.get("collapse_quote") and e.get("quote_where"), f"{e['id']}: the authors' words are not quoted"
        for f in e["files"]:
            path = corpus.HERE / f
            assert path.is_file(), f"{e['id']}: {f} missing"
            assert 0 < path.stat().st_size < 1_000_000, f"{f}: not a modest file"


def test_collapse_steps_as_the_authors_state_them():
    for e in ENTRIES:
        if e["outcome"] == "collapsed":
            assert isinstance(e["collapse_step"], int) and e["collapse_step"] > 0, e["id"]
            assert str(e["collapse_step"]) in e["collapse_quote"], f"{e['id']}: the step is not in the quote"
        else:
            assert e["collapse_step"] is None, e["id"]


def test_splits_are_disjoint_by_source():
    by_source: dict[str, set[str]] = {}
    for e in ENTRIES:
        by_source.setdefault(e["source"], set()).add(e["split"])
    for source, splits in by_source.items():
        assert len(splits) == 1, f"{source} is in several splits: {sorted(splits)}"
        assert DOC["sources"][source]["split"] in splits
    described = {DOC["sources"][s]["repository"] for s in by_source}
    assert len(described) == len({DOC["sources"][s]["repository"] for s in DOC["sources"]})


def test_key_maps_name_keys_rlwatch_recognises():
    for name, key_map in DOC["key_maps"].items():
        judged = recognise({key: 1.0 for key in key_map.values()})
        assert len(set(judged) - {"learning_rate"}) >= 2, name          # dynamics the alerts read, not only a rate
        users = [e for e in ENTRIES if e.get("key_map") == name]
        assert "reward_mean" in judged or all(e.get("reward_key") for e in users), f"{name}: no reward"


@pytest.mark.parametrize("entry", runs(), ids=lambda e: e.id)
def test_each_run_loads_with_its_reward(entry):
    run = corpus.load_run(entry)
    assert run.reward_key, entry.id
    assert len(run.steps) >= 10
    assert run.steps == sorted(run.steps)
    if entry.collapse_step is not None:
        assert run.steps[0] < entry.collapse_step <= run.steps[-1], "the collapse is inside the log"


def test_the_harness_replays_a_small_run(tmp_path):
    entry = next(e for e in runs() if e.id == SMALL)
    score = score_run(entry, tmp_path / "stores")
    assert (score.first_step, score.last_step, score.rows) == (1, 42, 42)
    assert score.collapse_step == 29 and score.outcome == "collapsed"
    assert score.paged_before == (score.first_page_step is not None and score.first_page_step < 29)
    for step, name, severity in score.fired:
        assert name.startswith("RLWatch") and severity in ("warning", "critical") and 1 <= step <= 42
    summary = summarise("tuning", [score])
    assert summary.collapses == 1 and summary.paged_before == int(score.paged_before)
    assert all(row["collapsed_runs"] == 1 and row["healthy_runs"] == 0 for row in summary.alerts.values())


def test_the_command_writes_its_figures(tmp_path, capsys):
    one = {**DOC, "runs": [e for e in ENTRIES if e["id"] == SMALL]}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(one), encoding="utf-8")
    assert main(["--split", "tuning", "--out", str(tmp_path / "out"), "--manifest", str(manifest)]) == 0
    out = capsys.readouterr().out
    assert "collapses paged before the authors' step" in out and SMALL in out
    report = json.loads((tmp_path / "out" / "realruns.json").read_text())
    assert report["tuning"]["figures"]["collapses"] == 1
    assert [r["id"] for r in report["tuning"]["runs"]] == [SMALL]


def test_the_doc_block_is_written_between_its_markers(tmp_path):
    from evaluation.realruns import report

    entry = next(e for e in runs() if e.id == SMALL)
    score = score_run(entry, tmp_path / "stores")
    text = report.block([summarise("tuning", [score])], [score])
    assert text.startswith(report.BEGIN) and text.endswith(report.END)
    assert f"| `{SMALL}` | tuning | collapsed at 29 |" in text
    page = tmp_path / "page.md"
    page.write_text(f"intro\n\n{report.BEGIN}\nold figures\n{report.END}\n\nafter\n", encoding="utf-8")
    assert not report.write(text, check=True, path=page)            # stale: said, not rewritten
    assert "old figures" in page.read_text(encoding="utf-8")
    assert report.write(text, check=False, path=page)
    assert report.write(text, check=True, path=page)
    assert page.read_text(encoding="utf-8") == f"intro\n\n{text}\n\nafter\n"


def test_a_swanlab_run_reads_its_own_columns_of_every_export():
    entry = next(e for e in runs() if e.format == "swanlab_csv" and e.id == "asycn-verl-sync-ent0.01-lr1e-5")
    run = corpus.load_run(entry)
    by_step = dict(zip(run.steps, run.rows))
    for path in entry.paths():
        header, *records = [line.split(",") for line in path.read_text(encoding="utf-8").splitlines()]
        for i, column in enumerate(header):
            if column.startswith(entry.column_prefix + "-") and column.endswith("_step"):
                key = column[len(entry.column_prefix) + 1:-len("_step")]
                cells = {int(r[0]): float(r[i]) for r in records if i < len(r) and r[i] != ""}
                assert {s: by_step[s][key] for s in cells} == cells, key
    assert by_step[15]["actor/entropy"] == pytest.approx(4.9663, abs=1e-4)    # "By step 15: entropy reached 4.97"
    others = {c for p in entry.paths() for c in p.read_text(encoding="utf-8").split("\n", 1)[0].split(",")}
    assert any(c.startswith("deepseek1.5b_sync_lr1e-5-") for c in others)          # another run's columns, not read
    assert all(not k.startswith("deepseek") for row in run.rows for k in row)


def test_the_observe_feed_carries_the_logged_aggregates_and_pages_as_the_replay(tmp_path):
    from evaluation.realruns import observe

    keys = {"entropy_mean": "e", "reward_mean": "r", "truncated_ratio": "t", "zero_std_ratio": "z"}
    fields = observe.step_fields({"e": 0.42, "r": 0.3, "t": 0.25, "z": 0.5}, keys)
    assert float(fields["entropy"].mean()) == pytest.approx(0.42)
    assert float(fields["rewards"].mean()) == pytest.approx(0.3)
    groups = fields["rewards"].reshape(observe.GROUPS, observe.GROUP_SIZE)
    assert float((groups.std(dim=1) == 0).float().mean()) == 0.5
    assert float(fields["truncated"].float().mean()) == 0.25
    entry = next(e for e in runs() if e.id == SMALL)
    replayed = score_run(entry, tmp_path / "replay")
    observed = score_run(entry, tmp_path / "observe", feed="observe")
    assert (observed.first_page_step, observed.first_warning_step) == \
        (replayed.first_page_step, replayed.first_warning_step) == (31, 25)
