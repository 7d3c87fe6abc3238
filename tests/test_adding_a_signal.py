"""docs/adding-a-signal.md's token example, declared from the guide's own block (read from the file, not
copied), computed on every path: eager stacked (64 positions), eager direct (8,192), eager direct in chunks
(524,288), inside a Watch, and compiled at each size; its value is the plain float64 definition, at
its threshold's default and set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rlwatch
from rlwatch.signals import quantities as q
from rlwatch.signals.pending import _div

from tests.conftest import make_step
from tests.test_declared_signal import declare
from tests.test_engine import _forget_compiled, run

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-signal.md"
SIZES = {64: (8, 8), 8_192: (64, 128), 524_288: (256, 2048)}


def _snippet(pattern: str) -> str:
    found = re.search(pattern, GUIDE.read_text(), re.DOTALL)
    assert found, f"docs/adding-a-signal.md no longer holds {pattern!r}"
    return found.group(1)


@pytest.fixture
def large_ratio(monkeypatch):
    """The guide's declaration block (its sum, metric with catalogue entry, and threshold), run from its text
    on the shipped tuples, then declared (the package's tuples and the catalogue patched)."""
    block = _snippet(r"At the end of `tokens.py`, one block:\n\n```python\n(.*?)```")
    names = {"TokenSum": q.TokenSum, "Metric": q.Metric, "Threshold": q.Threshold, "_div": _div, "torch": torch,
             "TERMS": dict(q.TERMS), "TOKEN_SUMS": q.TOKEN_SUMS, "METRICS": q.METRICS,
             "SIGNAL_THRESHOLDS": q.SIGNAL_THRESHOLDS}
    exec(block, names)                                                                   # noqa: S102 - our own doc
    declare(monkeypatch, terms={k: v for k, v in names["TERMS"].items() if k not in q.TERMS},
            token_sums=names["TOKEN_SUMS"][len(q.TOKEN_SUMS):], token_metrics=names["METRICS"][len(q.METRICS):],
            thresholds=names["SIGNAL_THRESHOLDS"][len(q.SIGNAL_THRESHOLDS):])
    yield names["METRICS"][-1].name
    _forget_compiled()


def _want(fields: dict, nats: float = 1.0) -> float:
    r = fields["trainer_logp"].double() - fields["sampler_logp"].double()
    return float((r[fields["mask"]].abs() > nats).double().mean())


@pytest.mark.parametrize("positions", SIZES)
def test_the_guides_token_signal_on_every_eager_path(large_ratio, positions):
    B, T = SIZES[positions]
    fields = make_step(B=B, T=T, seed=positions, noise=1.0)
    want = _want(fields)
    assert 0.05 < want < 0.95                         # the example step has both kinds of token
    assert rlwatch.compute(**fields)[large_ratio][()] == pytest.approx(want, rel=1e-6)
    config = rlwatch.SignalConfig(large_ratio_nats=0.5)                    # the threshold, set
    assert rlwatch.compute(config, **fields)[large_ratio][()] == pytest.approx(_want(fields, 0.5), rel=1e-6)


def test_the_guides_token_signal_inside_a_watch_at_8192_positions(large_ratio):
    fields = make_step(B=64, T=128, seed=3, noise=1.0)
    with rlwatch.Watch(run="guide", port=None, store=None, alerts=False, strict=True) as watch:
        values = watch.observe(0, **fields)
    assert values.value(large_ratio) == pytest.approx(_want(fields), rel=1e-6)
    with rlwatch.Watch(run="guide", port=None, store=None, alerts=False, strict=True, large_ratio_nats=2.0) as watch:
        values = watch.observe(0, **fields)
    assert values.value(large_ratio) == pytest.approx(_want(fields, 2.0), rel=1e-6)
    with pytest.raises(ValueError, match="large_ratio_nats"):
        rlwatch.Watch(run="guide", port=None, store=None, large_ratio_nats=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("positions", list(SIZES))
def test_the_guides_token_signal_compiled(large_ratio, positions):
    B, T = SIZES[positions]
    fields = make_step(B=B, T=T, seed=positions, noise=1.0)
    values, _ = run(fields, path="compiled")
    assert values[large_ratio][()] == pytest.approx(_want(fields), rel=1e-6)
