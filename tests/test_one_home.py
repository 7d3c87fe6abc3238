"""Issue 14, part C: one home per fact (one producer per series, one override validator, one
annotation renderer, one ``le`` format) and no import circle inside a subpackage."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rlwatch

PACKAGE = Path(rlwatch.__file__).parent


def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``rlwatch.<package>`` that the file imports (at any depth, lazily or not)."""
    here = f"rlwatch.{package}"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = here + (f".{node.module}" if node.module else "")
            elif node.level == 0 and node.module:
                base = node.module
            else:
                continue
            names = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith(here + ".") and n != f"{here}.__init__")
    return found


def _cycle(package: str) -> list[str] | None:
    files = {f"rlwatch.{package}.{p.stem}": p for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__"}
    graph = {mod: _imports(path, package) & set(files) for mod, path in files.items()}
    state: dict[str, int] = {}

    def visit(mod: str, trail: list[str]) -> list[str] | None:
        state[mod] = 1
        for nxt in sorted(graph[mod]):
            if state.get(nxt) == 1:
                return trail + [mod, nxt]
            if nxt not in state and (found := visit(nxt, trail + [mod])):
                return found
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod, [])):
            return found
    return None


@pytest.mark.parametrize("package", ["hacks"])
def test_no_import_circle_inside_the_subpackage(package):
    assert _cycle(package) is None


def test_prometheus_and_opentelemetry_write_the_same_le_labels():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prometheus_client import CollectorRegistry

    from rlwatch.exporters.prometheus import RLWatchCollector

    from .conftest import make_step

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with rlwatch.Watch(run="le", port=None, store=None, otel=provider, alerts=False) as watch:
        watch.observe(0, **make_step())
        otel = {point.attributes["le"]: point.value
                for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                for metric in sm.metrics if metric.name == "rlwatch_token_version_lag_tokens"
                for point in metric.data.data_points}
        registry = CollectorRegistry()
        registry.register(RLWatchCollector(watch.state))
        prom = {s.labels["le"]: s.value for family in registry.collect() for s in family.samples
                if s.name == "rlwatch_token_version_lag_bucket"}
    provider.shutdown()
    assert "1.0" in prom and "+Inf" in prom
    assert otel == prom


def test_alert_overrides_are_validated_once_the_same_way_by_every_reader():
    from rlwatch.alerts.catalogue import PARAMS, thresholds
    from rlwatch.alerts.evaluator import AlertEvaluator
    from rlwatch.alerts.windows import AlertWindows

    overrides = {"kl_k3_max": "0.5", "ess_min": "high", "nope": 1.0}
    expected = {**{name: p.default for name, p in PARAMS.items()}, "kl_k3_max": 0.5}
    assert thresholds(overrides) == expected
    assert AlertWindows(overrides).params == expected
    evaluator = AlertEvaluator("r1", overrides=overrides, watchdog_interval=0)
    evaluator.close()
    assert evaluator.params == expected
    assert evaluator.errors.counts[("alerts", "unknown_param")] == 2
    with rlwatch.Watch(run="o", port=None, store=None, alert_overrides=overrides) as watch:
        exported = {labels[0]: v for labels, v in watch.state.snapshot().gauges["alert_threshold"].items()}
    assert exported == expected
    assert watch.errors.counts[("alerts", "unknown_param")] == 2      # reported once, where the run starts
