"""The typed path of one step's inputs (issue 14): ``StepFields``, built by the integrations and by
``Watch.observe(step, **fields)`` alike, read once by the record builder."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import rlwatch
from rlwatch.core.fields import FIELDS, StepFields
from rlwatch import compute

from tests.conftest import make_step

INTEGRATIONS = Path(rlwatch.__file__).parent / "integrations"
#: Signal families only (the hook's own timing differs between two Watches).
TIMING = {"hook_compute_seconds", "hook_compute_seconds_total", "last_step_timestamp_seconds",
          "step_interval_seconds"}


def signals(values: dict) -> dict:
    return {name: family for name, family in values.items() if name not in TIMING}


def test_observe_keywords_and_typed_fields_give_the_same_step():
    fields = make_step(seed=3)
    with rlwatch.Watch(run="kw", port=None, store=None, alerts=False, strict=True) as by_keywords, \
            rlwatch.Watch(run="typed", port=None, store=None, alerts=False, strict=True) as typed:
        by_keywords_values = by_keywords.observe(7, **fields)
        typed_values = typed.observe_fields(7, StepFields(**fields))
    assert signals(by_keywords_values) == signals(typed_values)
    computed = compute(step=7, **fields)
    assert {name: typed_values[name] for name in computed} == computed


def test_step_fields_read_as_the_mapping_of_the_fields_that_are_set():
    mask, rewards = torch.ones(2, 3), torch.tensor([1.0, 0.0])
    fields = StepFields(mask=mask, rewards=rewards)
    assert dict(fields) == {"mask": mask, "rewards": rewards}
    assert "env" not in fields and fields.get("env") is None and len(fields) == 2
    # observe(step, **fields) still takes what an integration built (e.g. verl.fields_from_dataproto).
    with rlwatch.Watch(run="mapping", port=None, store=None, alerts=False, strict=True) as watch:
        assert watch.observe(1, **fields)["sequences"][()] == 2.0


def test_unknown_keywords_are_reported_once_and_episodes_only_reach_observe():
    parsed = StepFields.from_mapping({"mask": torch.ones(1, 1), "bogus": 1, "episodes": [{}]})
    assert parsed.unknown == ("bogus",) and parsed.episodes == [{}]
    assert StepFields.from_mapping({"episodes": []}, episodes=False).unknown == ("episodes",)
    assert set(StepFields.__dataclass_fields__) == FIELDS | {"episodes", "unknown"}
    with rlwatch.Watch(run="unknown", port=None, store=None, alerts=False) as watch:
        watch.observe(1, mask=torch.ones(2, 2), bogus=3)
        assert watch.errors.snapshot()[("validate", "unknown_field")] == 1


def test_no_integration_builds_a_keyword_dict_for_observe():
    calls = {str(p.relative_to(INTEGRATIONS)): re.findall(r"\.observe\(.*\*\*", p.read_text())
             for p in INTEGRATIONS.rglob("*.py")}
    assert {path: found for path, found in calls.items() if found} == {}
