"""Load: many steps with 1,000 environment labels (capped) while a client scrapes every second.

The store holds every step, memory stays flat, the exposition stays bounded, every scrape is served
(their latency is a speed figure: `python bench/load_test.py` reports it, the suite does not bar it).
The suite runs 20,000 steps (a few minutes on 2 cores); RLWATCH_LOAD_STEPS=100000 runs the full
load of the README's figures (also `python bench/load_test.py --steps 100000`)."""

from __future__ import annotations

import os

import pytest

from bench.load_test import run

pytestmark = pytest.mark.slow


def test_load_many_steps_many_environments_concurrent_scrapes(tmp_path):
    steps = int(os.environ.get("RLWATCH_LOAD_STEPS", "20000"))
    report = run(steps, envs=1000, directory=str(tmp_path))
    print(report)
    assert report["stored_steps"] == steps and report["contiguous"] and report["store_dropped"] == 0
    assert report["env_series"] == 65                        # 1,000 environments: 64 labels + "other"
    # The scraper asks every second for as long as the run lasts, so the scrapes it got are tied to the
    # run's duration, never a fixed count: at least one per two seconds (a scrape may take a while on a
    # loaded machine), and at least two, so that the memory and exposition comparisons below compare.
    assert report["scrape_errors"] == 0
    assert report["scrapes"] >= max(2, int(report["seconds"] // 2) - 1), report
    assert report["exposition_bytes_max"] < 2 * report["exposition_bytes_first"]
    assert report["rss_late_mib"] - report["rss_early_mib"] < 64           # no growth with the step count
