"""``rlwatch replay`` of OpenRLHF's console log, written by OpenRLHF's own logger
(``openrlhf.utils.logging_utils.init_logger``, the message of ``PPOTrainer.fit``) in OpenRLHF's
environment (``.venv-openrlhf``, a subprocess): skipped where that environment is not set up (failed
under RLWATCH_REQUIRE_FRAMEWORKS=1, as in CI, where ``make test`` sets it up first)."""

from __future__ import annotations

import pytest

from rlwatch.replay import load, replay

from ._replay_helpers import DROP, collapsed_rows, openrlhf_python, write_openrlhf_log
from .conftest import REQUIRE_FRAMEWORKS

pytestmark = pytest.mark.slow          # OpenRLHF's environment starts in a subprocess (10-20 s)


@pytest.fixture(scope="module")
def openrlhf_log(tmp_path_factory):
    python = openrlhf_python()
    if python is None:
        missing = "OpenRLHF's environment (.venv-openrlhf, `make openrlhf-venv`) is not set up"
        pytest.fail(missing) if REQUIRE_FRAMEWORKS else pytest.skip(missing)
    rows = collapsed_rows()
    rows[5][1]["loss"] = float("nan")
    return rows, write_openrlhf_log(tmp_path_factory.mktemp("openrlhf") / "train.log", rows, python)


def test_openrlhf_log_parses_to_the_logged_rows(openrlhf_log):
    rows, path = openrlhf_log
    run = load(path)
    assert run.fmt == "openrlhf" and run.reward_key == "reward"
    assert run.steps == [s for s, _ in rows]
    assert run.rows[0] == pytest.approx(rows[0][1])
    assert run.nonfinite == {"loss": [rows[5][0]]}
    evaluated = {s: row["eval_gsm8k_pass1"] for s, row in zip(run.steps, run.rows) if "eval_gsm8k_pass1" in row}
    assert evaluated == pytest.approx({s: v["reward"] for s, v in rows if s % 20 == 0})     # its eval lines
    assert run.recognised()["eval_gsm8k_pass1"] == "heldout_score"


def test_a_collapsed_openrlhf_run_names_the_collapse(openrlhf_log, tmp_path):
    result = replay(load(openrlhf_log[1]), store_dir=tmp_path)
    assert result.collapse_step == DROP
