"""Exporters: Prometheus (pull and push) and OpenTelemetry, each reading one run's snapshot."""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

from ..metrics import LAG_BUCKETS


def le_labels(bounds: tuple[float, ...] = LAG_BUCKETS) -> list[str]:
    """The ``le`` label of each histogram bucket, then ``+Inf``, as prometheus_client writes them
    ("0.0", "1.0", ..., "+Inf"): the one format of every exporter, so the same bucket has the same
    series in Prometheus and through OpenTelemetry."""
    return [floatToGoString(b) for b in bounds] + ["+Inf"]
