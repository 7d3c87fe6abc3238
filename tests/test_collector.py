"""The Prometheus collector: every catalogue family it yields is described at registration, so two
families exported under one name are refused there (not at a scrape, by a strict parser)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from rlwatch.core.metrics import MetricSpec
from rlwatch.core.state import MetricState
from rlwatch.exporters.prometheus import RLWatchCollector, exported

from tests.conftest import patch_catalogue


def test_describe_names_every_exported_family_and_registration_reads_it():
    registry = CollectorRegistry(auto_describe=False)           # as the hook registers it
    collector = RLWatchCollector(MetricState("r"))
    registry.register(collector)
    described = {metric.name for metric in collector.describe()}
    assert len(described) == len(exported()) > 100
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(RLWatchCollector(MetricState("r")))      # the same families twice in one registry


@pytest.mark.parametrize("clash", [
    MetricSpec("steps", "gauge", "A gauge beside the counter steps_total: one OpenMetrics family.", (), "step"),
    MetricSpec("entropy_mean", "gauge", "A second entry of one name.", (), "step"),
])
def test_two_families_with_one_name_are_refused_at_registration(monkeypatch, clash):
    patch_catalogue(monkeypatch, (clash,))
    registry = CollectorRegistry(auto_describe=False)
    with pytest.raises(ValueError, match=f"exported as rlwatch_{clash.name}.*{clash.name}"):
        registry.register(RLWatchCollector(MetricState("r")))
