"""Comparing a framework run's step values with those computed from its own tensors (verl, OpenRLHF)."""

from __future__ import annotations

import math

import pytest

#: Values that measure time, not the step: never equal between two computations.
TIMING_KEYS = {"hook_compute_seconds", "hook_compute_seconds_total", "last_step_timestamp_seconds",
               "step_interval_seconds"}


def assert_values_close(got: dict, want: dict) -> None:
    """Every series of ``want`` (but timings and private ``_`` ones) in ``got``, equal within 1e-6 relative
    (None and NaN alike: no value)."""
    for name, series in want.items():
        if name in TIMING_KEYS or name.startswith("_"):
            continue
        assert name in got, name
        for labels, value in series.items():
            other = got[name].get(labels)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                assert other is None or math.isnan(other), (name, labels, other)
            else:
                assert other == pytest.approx(value, rel=1e-6, abs=1e-9), (name, labels, other, value)
