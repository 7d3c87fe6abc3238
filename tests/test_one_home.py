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


@pytest.mark.parametrize("package", ["hacks", "alerts", "integrations", "postmortem"])
def test_no_import_circle_inside_the_subpackage(package):
    assert _cycle(package) is None


def test_prometheus_and_opentelemetry_write_the_same_le_labels():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prometheus_client import CollectorRegistry

    from rlwatch.exporters.prometheus import RLWatchCollector

    from tests.conftest import make_step

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


def test_one_helper_writes_every_bucket_label():
    """rlwatch.signals.buckets.bucket_labels (the catalogue re-exports it): the ``le`` format is
    prometheus_client's, the in-process and range labels are the ones exported, and no other module spells a
    bound as a label."""
    from prometheus_client.utils import floatToGoString

    from rlwatch.core import metrics

    bounds = (0, 1, 2.5, 0.001, 1e-9, 123456.0, 1e6, 1e7, 12345678.9, 1e20)
    assert metrics.bucket_labels(bounds, "le") == (*(floatToGoString(b) for b in bounds), "+Inf")
    assert metrics.LAG_LE_LABELS == (*(floatToGoString(b) for b in metrics.LAG_BUCKETS), "+Inf")
    assert metrics.LAG_BUCKET_LABELS == ("0", "1", "2", "3", "4", "6", "8", "12", "16", "24", "32", "+Inf")
    assert metrics.PROB_BIN_LABELS == ("0.0-0.1", "0.1-0.5", "0.5-0.9", "0.9-1.0")
    spelled = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "buckets.py"
               and any(s in p.read_text() for s in ("floatToGoString", '"+Inf",', "le_labels"))]
    assert not spelled


def test_alert_overrides_are_validated_once_the_same_way_by_every_reader():
    from rlwatch.alerts.catalogue import PARAMS, thresholds
    from rlwatch.alerts.evaluator import AlertEvaluator
    from rlwatch.alerts.windows import AlertWindows

    overrides = {"kl_k3_max": "0.5", "ess_min": 0.2}
    expected = {**{name: p.default for name, p in PARAMS.items()}, "kl_k3_max": 0.5, "ess_min": 0.2}
    assert thresholds(overrides) == expected
    assert AlertWindows(overrides).params == expected
    evaluator = AlertEvaluator("r1", overrides=overrides, watchdog_interval=0)
    evaluator.close()
    assert evaluator.params == expected
    with rlwatch.Watch(run="o", port=None, store=None, alert_overrides=overrides) as watch:
        exported = {labels[0]: v for labels, v in watch.state.snapshot().gauges["alert_threshold"].items()}
    assert exported == expected
    for invalid in ({"ess_min": "high"}, {"nope": 1.0}):
        for reader in (thresholds, AlertWindows, lambda o: AlertEvaluator("r1", overrides=o, watchdog_interval=0),
                       lambda o: rlwatch.Watch(run="o", port=None, store=None, alert_overrides=o)):
            with pytest.raises(ValueError):
                reader(invalid)


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.1, "100ms"), (0.0001234, "123.4us"), (1, "1s"), (1.2345, "1.234s"), (42.5, "42.5s"),
    (60, "1m 0s"), (960, "16m 0s"), (3600, "1h 0m 0s"), (3725, "1h 2m 5s"), (86400 + 3600 + 61, "1d 1h 1m 1s"),
    (-3600, "-1h 0m 0s"), (float("nan"), "NaN"), (float("inf"), "+Inf")])
def test_humanize_duration_is_prometheus(seconds, text):
    """Prometheus' template tests (prometheus/template/template_test.go) for humanizeDuration."""
    from rlwatch.alerts.template import humanize_duration

    assert humanize_duration(seconds) == text


@pytest.mark.parametrize("value, text", [(0.1, "0.1"), (100000.0, "100000"), (1e6, "1e+06"),
                                         (123456789.0, "1.23456789e+08"), (1e-05, "1e-05"), (0.0001, "0.0001"),
                                         (2.0, "2"), (float("-inf"), "-Inf")])
def test_plain_value_is_go_percent_v(value, text):
    from rlwatch.alerts.template import go_float

    assert go_float(value) == text


def test_the_in_process_stall_event_reads_as_prometheus_and_promtool_expect():
    """The evaluator's event text is the annotation the generated promtool test expects (and promtool
    checks that against Prometheus' own rendering in tests/test_alert_rules.py)."""
    from rlwatch.alerts.catalogue import BY_NAME
    from rlwatch.alerts.evaluator import AlertEvaluator

    from tests.test_alert_rules import example_steps

    alert = BY_NAME["RLWatchTrainerStalled"]
    evaluator = AlertEvaluator("r1", watchdog_interval=0, clock=lambda: 16 * 60.0)
    evaluator.on_step(0, example_steps(alert)[0][1])
    evaluator.check_stalled()
    (event,) = evaluator.firing()
    evaluator.close()
    assert event.description == "Run r1: no step for 16m 0s."
    promtool_test = (Path(rlwatch.__file__).parents[1] / "alerts" / "rlwatch-rules.test.yaml").read_text()
    assert f'description: "{event.description}"' in promtool_test


def test_health_is_folded_once_per_scrape(monkeypatch):
    from prometheus_client import generate_latest

    from rlwatch.hook.lifecycle import Health

    from tests.conftest import make_step

    folds = []
    fold = Health.fold
    monkeypatch.setattr(Health, "fold", lambda self: (folds.append(1), fold(self)))
    with rlwatch.Watch(run="fold", port=None, store=None, alerts=False) as watch:
        watch.observe(0, **make_step())
        folds.clear()
        body, _, _ = watch.services.exposition.render()
        assert len(folds) == 1 and body.startswith(b"# HELP")
        watch.observe(1, **make_step())
        folds.clear()
        watch.services.exposition.render("application/openmetrics-text")
        assert len(folds) == 1
        folds.clear()
        generate_latest(watch.services.registry)       # a push or a user's own generate_latest: folded too
        assert len(folds) == 1


def test_hack_ratio_is_one_fact_over_both_sources_of_verdicts():
    """The step's ``hacked`` flags and a detector judging the same (env, detector): the counters add
    up, and env_hack_ratio is hacked/judged of those counters, not the detector's verdicts alone."""
    import torch

    from rlwatch import hacks

    from tests.conftest import make_step

    step = make_step(B=4, T=4, envs=("math",))
    step["hacked"] = {"v": torch.tensor([True, False, False, False])}
    episodes = [{"reward": 1.0, "response": f"r{i}", "prompt": "p"} for i in range(4)]
    detectors = [hacks.Detector("v", lambda ep: (True, "always"))]
    with rlwatch.Watch(run="h", port=None, store=None, alerts=False, hack_detectors=detectors) as watch:
        watch.observe(0, **step, episodes=episodes)
        watch.hacks.flush()
        values = watch.observe(1, **step)
        watch.flush()
    assert values["episodes_judged_total"][("math", "v")] == 8
    assert values["episodes_hacked_total"][("math", "v")] == 5
    assert values["env_hack_ratio"][("math", "v")] == 5 / 8


def _producers_of(name: str) -> set[str]:
    """Modules of rlwatch that write the family ``name`` into step values: ``x[name] = ...``,
    ``x.setdefault(name, ...)`` or ``x.set(name, ...)``."""
    import ast

    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            keys = [t.slice for t in targets if isinstance(t, ast.Subscript)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("setdefault", "set") and node.args:
                keys.append(node.args[0])
            if any(isinstance(k, ast.Constant) and k.value == name for k in keys):
                found.add(str(path.relative_to(PACKAGE)))
    return found


def test_hack_ratio_has_one_home_that_compute_and_the_pipeline_share():
    """``env_hack_ratio`` is written by rlwatch.signals.derived.derive_hack_ratios only; rlwatch.compute() still
    returns it, equal to the two counters it divides."""
    import torch

    from tests.conftest import make_step

    assert _producers_of("env_hack_ratio") == {"signals/derived.py"}
    step = make_step(B=4, T=4, envs=("math", "code"))
    values = rlwatch.compute(**step, hacked={"v": torch.tensor([True, False, False, False])})
    judged, hacked = values["episodes_judged_total"], values["episodes_hacked_total"]
    assert values["env_hack_ratio"] == {k: hacked[k] / n for k, n in judged.items()}
    assert values["env_hack_ratio"] == {("math", "v"): 0.5, ("code", "v"): 0.0}
