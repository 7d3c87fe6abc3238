"""User-named phases and step numbers as untrusted input: phase names capped per run like
environments (``other`` beyond), long names cut without merging two phases, a phase name of any
type never raising into the trainer, and a fractional step refused rather than rounded."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import rlwatch
from rlwatch.core.record import PHASE_NAME_LENGTH

from tests.conftest import make_step


def _phase_series(watch: rlwatch.Watch) -> dict[str, float]:
    watch.flush()
    text = urllib.request.urlopen(watch.url, timeout=5).read().decode()
    return {s.labels["phase"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "rlwatch_step_phase_seconds"}


def _phase_totals(watch: rlwatch.Watch) -> int:
    text = urllib.request.urlopen(watch.url, timeout=5).read().decode()
    return sum(line.startswith("rlwatch_phase_seconds_total{") for line in text.splitlines())


def test_twenty_thousand_phase_names_make_at_most_cap_plus_one_series():
    """20,000 distinct phase names over two steps: 32 phases kept by name, the rest add up in
    ``other``, counted once as a validation error; the exposition stays small."""
    with rlwatch.Watch(run="phases", port=0, store=None, alerts=False) as watch:
        watch.observe(0, mask=torch.ones(2, 3), phases={f"p{i}": 0.001 for i in range(10000)})
        watch.observe(1, mask=torch.ones(2, 3), phases={f"q{i}": 0.001 for i in range(10000)})
        series = _phase_series(watch)
        body = urllib.request.urlopen(watch.url, timeout=5).read()
        assert _phase_totals(watch) <= 33
        assert watch.errors.counts.get(("validate", "label_cap"), 0) >= 1
    assert len(series) <= 33 and "other" in series, len(series)
    assert series["other"] == pytest.approx(10000 * 0.001)              # step 1: every q-name is over the cap
    assert len(body) < 200_000, len(body)


def test_long_phase_names_that_share_a_prefix_stay_two_phases():
    first, second = "rollout/" + "x" * 40 + "/math", "rollout/" + "x" * 40 + "/code"
    with rlwatch.Watch(run="long", port=0, store=None, alerts=False, strict=True) as watch:
        watch.observe(0, mask=torch.ones(2, 3), phases={first: 1.0, second: 2.0})
        series = _phase_series(watch)
    assert sorted(series.values()) == [1.0, 2.0], series
    assert all(len(name) <= PHASE_NAME_LENGTH for name in series)
    assert all(name.startswith("rollout/xxxx") for name in series)


def test_a_phase_named_by_anything_never_raises_into_the_trainer():
    """``with watch.phase(<unhashable>)`` around code that raises: the trainer's own exception comes
    out, not a TypeError of rlwatch's; without one, the block is timed under the name's text."""
    with rlwatch.Watch(run="odd", port=0, store=None, alerts=False) as watch:
        with pytest.raises(KeyError, match="the trainer's own"):
            with watch.phase(["sync"]):
                raise KeyError("the trainer's own")
        with watch.phase({"a": 1}):
            pass
        watch.observe(0, **make_step())
        series = _phase_series(watch)
    assert set(series) == {"['sync']", "{'a': 1}"}, series


def test_a_fractional_step_is_refused_not_rounded():
    with rlwatch.Watch(run="steps", port=0, store=None, alerts=False) as watch:
        watch.observe(1.5, **make_step())
        watch.observe(2.0, **make_step())                                 # a whole float is that step
        watch.flush()
        assert watch.errors.counts.get(("validate", "type"), 0) == 1
        text = urllib.request.urlopen(watch.url, timeout=5).read().decode()
    steps = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name in ("rlwatch_steps_total", "rlwatch_step")}
    assert steps == {"rlwatch_steps_total": 1.0, "rlwatch_step": 2.0}, steps
    with rlwatch.Watch(run="strict", port=0, store=None, alerts=False, strict=True) as watch:
        with pytest.raises(Exception, match="step"):
            watch.observe(1.5, **make_step())
