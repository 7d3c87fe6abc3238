"""Exporters: Prometheus (pull and push) and OpenTelemetry, each reading one run's snapshot."""

from __future__ import annotations
