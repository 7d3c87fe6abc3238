"""What a user reads says only what a user can place and check: no development history (issue numbers,
sessions, commit hashes, "tuning split" asides) in the README, the docs or the runbook; the tutorial the
rollout-system figures come from named where it is cited; the install section true while the
distribution is not on PyPI (and a release checklist in CONTRIBUTING); every demo scenario and the TRL
version the extra pins listed; every figure in docs/results.md with its command, date and commit."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from rlwatch.demo.scenario import SCENARIOS
from rlwatch.ops.cli import main

ROOT = Path(__file__).resolve().parents[1]
USER_TEXT = [ROOT / "README.md", ROOT / "alerts" / "runbook.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = re.compile(r"\bissues? #?\d+|\bsessions?\b|tuning split|before this change|\bcited from\b", re.I)
#: A commit hash: 7-40 hex digits with at least one digit and one letter (not a word, not a number).
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
#: Where a commit may appear: a figure's provenance in docs/results.md.
PROVENANCE = re.compile(r"measured 20\d\d-\d\d-\d\d at ([0-9a-f]{7,40})\b")
TUTORIAL = "Rollout Systems and Off-Policy Correction"


def _ours(digits: str) -> bool:
    """True when ``digits`` name a commit of this repository (history); another repository's commit, cited
    as the source of a copied log or key name (docs/real-runs.md, docs/trainer-dynamics.md), is not.
    Without a git checkout every hash counts as ours."""
    try:
        found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "-q", "--verify", f"{digits}^{{commit}}"],
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return found.returncode == 0 or not (ROOT / ".git").exists()


@pytest.mark.parametrize("path", USER_TEXT, ids=lambda p: p.name)
def test_user_text_carries_no_development_history(path):
    text = path.read_text()
    found = [m.group(0) for m in HISTORY.finditer(text)]
    allowed = {m.group(1) for m in PROVENANCE.finditer(text)} if path.name == "results.md" else set()
    found += [m.group(0) for m in COMMIT.finditer(text) if m.group(0) not in allowed and _ours(m.group(0))]
    assert not found, f"{path.relative_to(ROOT)}: {found}"


def _whatif_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["whatif", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_the_tutorial_is_named_where_it_is_cited(capsys):
    unplaced = re.compile(r"reference (text|chapter|experiment)|the reference's|in the reference\b")
    help_text = _whatif_help(capsys)
    for name, text in [(p.name, p.read_text()) for p in USER_TEXT] + [("whatif --help", help_text)]:
        assert not unplaced.search(text), f"{name}: {unplaced.search(text).group(0)}"
    for name, text in (("README.md", (ROOT / "README.md").read_text()),
                       ("docs/whatif.md", (ROOT / "docs" / "whatif.md").read_text()), ("whatif --help", help_text)):
        assert TUTORIAL in " ".join(text.split()), name


def test_the_install_section_is_true_and_contributing_says_how_to_release():
    readme = (ROOT / "README.md").read_text()
    commands = [line.strip() for block in re.findall(r"```sh\n(.*?)```", readme, re.S) for line in block.splitlines()]
    assert not [c for c in commands if re.match(r"pip install '?rlwatch-llm\b", c)], "not published"
    assert "not on PyPI yet" in readme
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    used = set(re.findall(r"\bmake ([a-z][a-z-]*)", readme))
    assert {"demo", "test", "dist"} <= used and used <= targets, used - targets
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    release = contributing[contributing.index("## Releasing"):]
    for step in ("make dist", "twine check", "fresh venv", "twine upload"):
        assert step in release, step


def test_the_readme_lists_every_demo_scenario_and_the_pinned_trl():
    readme = (ROOT / "README.md").read_text()
    assert [name for name in SCENARIOS if f"`{name}`" not in readme] == []
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]
    trl = re.search(r"trl==(\d+\.\d+)", " ".join(pins)).group(1)
    assert re.findall(r"TRL (\d+\.\d+(?:-\d+\.\d+)?)", readme) == [trl]


def test_every_figure_in_the_results_has_a_command_a_date_and_a_commit():
    """Each row of a table with a command column names its command and its provenance (or, stating no
    figure, says to run its command to measure); each section without one (the demo, the acceptance
    suite) gives its commands in a block and its provenance."""
    text = (ROOT / "docs" / "results.md").read_text()
    dated = re.compile(r"measured 20\d\d-\d\d-\d\d at [0-9a-f]{7,40}\b")
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = [c.strip() for c in line.strip("|").split("|")]
        elif not line.startswith("|---") and "command" in header:
            rows.append(dict(zip(header, [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))])))
    assert len(rows) >= 20
    assert "commit not recorded" not in text, "measure it again at a commit, or state no figure"
    for row in rows:
        assert row["command"].startswith(("`", "same")), row
        result = next(v for k, v in row.items() if k.startswith("result"))
        unmeasured = "run it to measure" in result and not re.search(r"\d", result)     # no figure: its command
        assert dated.search(result) or unmeasured, row
    for section in text.split("\n## ")[1:]:
        assert dated.search(section), section[:60]
        assert "```sh" in section or "| command |" in section or "`python" in section, section[:60]
