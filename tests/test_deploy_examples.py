"""The deployment examples parse and point at files that exist; the endpoint binds loopback."""

from __future__ import annotations

import yaml

import rlwatch
from rlwatch.alerts import render

from tests.conftest import ROOT

DEPLOY = ROOT / "examples" / "deploy"


def test_compose_file_mounts_existing_files():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"prometheus", "alertmanager", "grafana"}
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DEPLOY / source).resolve().exists(), source
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:")                  # published on loopback only
    assert "grafana/grafana:11" in compose["services"]["grafana"]["image"]


def test_prometheus_config_loads_the_rules_and_discovery():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/rlwatch-rules.yaml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # Registration only, no fixed port list (RLWatchExporterDown must not page for unused ports).
    assert list(jobs) == ["rlwatch-sd"] and jobs["rlwatch-sd"]["honor_labels"]
    assert "file_sd_configs" in jobs["rlwatch-sd"] and "static_configs" not in jobs["rlwatch-sd"]


def test_kubernetes_manifests():
    monitor = yaml.safe_load((DEPLOY / "kubernetes" / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor" and monitor["spec"]["podMetricsEndpoints"][0]["port"] == "rlwatch"
    rule = yaml.safe_load((ROOT / "alerts" / render.PROMETHEUS_RULE_FILE).read_text())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"] == yaml.safe_load(render.rules_yaml())


def test_endpoint_binds_loopback_unless_asked():
    with rlwatch.Watch(run="bind", port=0, store=None) as watch:
        host, _ = watch.server._socket.getsockname()[:2]
        assert host == "127.0.0.1"
        assert watch.metadata["torch_version"] and watch.metadata["python_version"]


def test_ha_example_sends_to_both_alertmanagers_without_the_replica_label():
    """examples/deploy/ha: both replicas alert both cluster members with identical labels (run by
    tests/test_alert_delivery_e2e.py with the Debian servers)."""
    config = yaml.safe_load((DEPLOY / "ha" / "prometheus.yml").read_text())
    assert len(config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]) == 2
    assert {"action": "labeldrop", "regex": "replica"} in config["alerting"]["alert_relabel_configs"]
    assert set(config["global"]["external_labels"]) == {"replica"}
    assert "--cluster.peer=" in (DEPLOY / "ha" / "README.md").read_text()
