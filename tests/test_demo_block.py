"""scripts/demo_block.py: the demo's output quoted in README.md and docs/results.md is generated, and its
check fails on a stale figure (the demo itself is run by ``make check`` and by tests/test_demo.py)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("demo_block", ROOT / "scripts" / "demo_block.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The shape of `rlwatch demo --no-live`'s stdout (progress, transitions, post-mortem, closing lines).
OUTPUT = """rlwatch: serving http://127.0.0.1:40949/metrics (run 'demo-collapse')
step   0 [healthy] held-out true reward 0.20, k3 0.0000; firing now: nothing
step 5: FIRING RLWatchVersionLagFarAboveBound (critical) value 5
step 49: RESOLVED RLWatchKLSpike (critical) value 0.07419
report and plots: /tmp/x/collapse-20261204-155108/report/postmortem.md

The critical alert RLWatchVersionLagFarAboveBound fired at step 5, 13 steps before the collapse (held-out \
reward lost at step 18).
Cause: stale_weights. Resume from: no checkpoint (/tmp/x/collapse-20261204-155108/checkpoints/checkpoint-14 \
(step 14) is the last one).
Run store /tmp/x/collapse-20261204-155108/run.db; report and plots in /tmp/x/collapse-20261204-155108/report \
(6 s of training).
Next: `rlwatch up`
"""


def test_the_block_quotes_the_transitions_and_closing_lines_without_machine_paths():
    demo_block = _module()
    full = demo_block.block(OUTPUT)
    assert "step 5: FIRING RLWatchVersionLagFarAboveBound (critical) value 5" in full
    assert "step 49: RESOLVED RLWatchKLSpike (critical) value 0.07419" in full
    assert "13 steps before the collapse (held-out reward lost at step 18)" in full
    assert "rlwatch-demo/collapse-<time>/checkpoints/checkpoint-14" in full
    assert "/tmp/x" not in full and "Run store" not in full and "s of training" not in full
    short = demo_block.block(OUTPUT, transitions=False)
    assert "FIRING" not in short and "13 steps before the collapse" in short
    with pytest.raises(ValueError):
        demo_block.block("step 3 [healthy] ...\n")             # a demo that did not finish


def test_check_fails_on_a_stale_figure_and_write_repairs_it(tmp_path, capsys):
    demo_block = _module()
    for name in demo_block.FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    saved = tmp_path / "demo.out"
    saved.write_text(OUTPUT)
    args = ["--from", str(saved), "--root", str(tmp_path)]
    assert demo_block.main(["--write", *args]) == 0
    assert demo_block.main(["--check", *args]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("13 steps before", "12 steps before"))    # a stale figure
    capsys.readouterr()
    assert demo_block.main(["--check", *args]) == 1
    err = capsys.readouterr().err
    assert "README.md" in err and "-The critical alert RLWatchVersionLagFarAboveBound fired at step 5, 12" in err
    assert "demo_block.py --write" in err
    readme.write_text(readme.read_text().replace(demo_block.END, ""))                       # a broken marker
    assert demo_block.main(["--check", *args]) == 1


def test_the_checked_in_documents_carry_one_generated_block_each():
    demo_block = _module()
    for name, transitions in demo_block.FILES.items():
        text = (ROOT / name).read_text()
        assert text.count(demo_block.BEGIN) == 1 and text.count(demo_block.END) == 1, name
        inside = text.split(demo_block.BEGIN, 1)[1].split(demo_block.END, 1)[0]
        assert "$ rlwatch demo --no-live" in inside and ("FIRING" in inside) == transitions, name


@pytest.mark.slow
def test_the_documents_quote_what_the_demo_prints_today():
    """A real `rlwatch demo --no-live` (about 10 s of training): the blocks in README.md and
    docs/results.md are what it prints (`make check` runs the same check; this one runs in `make test`)."""
    assert _module().main(["--check"]) == 0, "run `python scripts/demo_block.py --write`"
