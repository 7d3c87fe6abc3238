"""Shared by the Watch tests (tests/test_watch_*.py): scraping a live /metrics endpoint."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, **kwargs) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5, **kwargs) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            s.labels.pop("run_instance", None)          # the keys name the run only
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]
