"""docs/adding-a-signal.md's token example, declared from the guide's own snippets (read from the file, not
copied), computed on every path: eager stacked (64 positions), eager direct (8,192), eager direct in chunks
(524,288), inside a Watch, and compiled; its value is the plain float64 definition."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import rlwatch
import rlwatch.exporters.prometheus  # noqa: F401 - holds CATALOGUE from its import: imported before the patch
from rlwatch.core import metrics
from rlwatch.signals import quantities as q
from rlwatch.signals.pending import _div

from tests.conftest import make_step
from tests.test_engine import _forget_compiled, run

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-signal.md"
SIZES = {64: (8, 8), 8_192: (64, 128), 524_288: (256, 2048)}


def _snippet(pattern: str) -> str:
    found = re.search(pattern, GUIDE.read_text())
    assert found, f"docs/adding-a-signal.md no longer holds {pattern!r}"
    return found.group(1)


@pytest.fixture
def large_ratio(monkeypatch):
    """The guide's term, sum, metric and catalogue entry, evaluated from its text."""
    names = {"torch": torch, "TokenSum": q.TokenSum, "Metric": q.Metric, "_div": _div, "_g": metrics._g}
    term_name, term = re.match(r'"(\w+)":\s*(lambda .*),$', _snippet(r'TERMS = \{\n\s+\.\.\.\n\s+(.*)\n')).groups()
    token_sum = eval(_snippet(r"TOKEN_SUMS = \(\n\s+\.\.\.\n\s+(.*),\n"), names)          # noqa: S307 - our own doc
    metric = eval(_snippet(r"METRICS = \(\n\s+\.\.\.\n\s+(.*),\n"), names)                # noqa: S307
    spec = eval(_snippet(r"```python\n\s+(_g\(.*\)),\n```"), names)                       # noqa: S307
    monkeypatch.setitem(q.TERMS, term_name, eval(term, names))                           # noqa: S307
    monkeypatch.setattr(q, "TOKEN_SUMS", q.TOKEN_SUMS + (token_sum,))
    monkeypatch.setattr(q, "METRICS", q.METRICS + (metric,))
    catalogue = metrics.CATALOGUE
    for module in [m for name, m in sys.modules.items() if name.startswith("rlwatch")]:
        if getattr(module, "CATALOGUE", None) is catalogue:
            monkeypatch.setattr(module, "CATALOGUE", catalogue + (spec,))
    monkeypatch.setitem(metrics.BY_NAME, spec.name, spec)
    _forget_compiled()
    yield metric.name
    _forget_compiled()


def _want(fields: dict) -> float:
    r = fields["trainer_logp"].double() - fields["sampler_logp"].double()
    return float((r[fields["mask"]].abs() > 1.0).double().mean())


@pytest.mark.parametrize("positions", SIZES)
def test_the_guides_token_signal_on_every_eager_path(large_ratio, positions):
    B, T = SIZES[positions]
    fields = make_step(B=B, T=T, seed=positions, noise=1.0)
    want = _want(fields)
    assert 0.05 < want < 0.95                         # the example step has both kinds of token
    assert rlwatch.compute(**fields)[large_ratio][()] == pytest.approx(want, rel=1e-6)


def test_the_guides_token_signal_inside_a_watch_at_8192_positions(large_ratio):
    fields = make_step(B=64, T=128, seed=3, noise=1.0)
    with rlwatch.Watch(run="guide", port=None, store=None, alerts=False, strict=True) as watch:
        values = watch.observe(0, **fields)
    assert values.value(large_ratio) == pytest.approx(_want(fields), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("positions", [64, 8_192])
def test_the_guides_token_signal_compiled(large_ratio, positions):
    B, T = SIZES[positions]
    fields = make_step(B=B, T=T, seed=positions, noise=1.0)
    values, _ = run(fields, path="compiled")
    assert values[large_ratio][()] == pytest.approx(_want(fields), rel=1e-6)
