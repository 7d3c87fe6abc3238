"""Issue 40, item 3: an alert is added in its domain module alone (CONTRIBUTING, "Where a change goes").

The test makes one edit to a copy of ``rlwatch/alerts/domains/staleness.py`` (a new alert
``RLWatchVersionLagHigh`` with a new threshold ``lag_high_max`` declared in the module's ``PARAMS``
and the role ``lag``, appended to the module's ``ALERTS``), puts that copy ahead of the shipped one
on the ``rlwatch.alerts.domains`` package path in a fresh interpreter, and finds the alert, with
nothing else edited, in the catalogue, the rendered rules, runbook and promtool tests, the thresholds
(``PARAMS``, ``validate_overrides``), the in-process evaluator (it fires on its example, and not
once its threshold is overridden) and the post-mortem's role lists. A new domain module (a file
of its own in the package) is found too, after the declared ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, need_binary

DOMAINS = ROOT / "rlwatch" / "alerts" / "domains"

NEW_PARAM = '''    "lag_high_max": Param(3.0, "Maximum version lag above which RLWatchVersionLagHigh opens.", low=1.0),
'''

NEW_ALERT = '''
VERSION_LAG_HIGH = Alert(
    name="RLWatchVersionLagHigh", severity="warning", for_steps=2, roles=("lag",),
    params=("lag_high_max", "hold_fraction", "clear_steps"),
    summary="The maximum version lag is high.",
    description="Run {{ $labels.run }}: the oldest token trained is {{ $value }} updates stale.",
    windows="The maximum lag above `lag_high_max` for 2 steps.",
    condition=lambda h: past(h, h.latest("version_lag_max"), h.p("lag_high_max")),
    runbook=Runbook(meaning="Stale data.", causes=["A slow rollout worker."], look=["rlwatch_version_lag_max."],
                    do=["Enforce the staleness bound."]),
    example=StepExample(series=with_step(6, version_lag_max={(): [1.0, 1.0, 1.0, 7.0, 7.0, 7.0]}),
                        fires_at=4, labels={}, value=7.0),
)

'''

#: A whole new domain module, found without being named anywhere else.
NEW_DOMAIN = '''"""A domain of the test: one alert on the entropy."""

from ..conditions import one
from ..model import Alert, Param, Runbook, StepExample, with_step

PARAMS = {"entropy_floor_test": Param(0.5, "Entropy below which RLWatchEntropyFloorTest opens.", above=0.0)}

ENTROPY_FLOOR = Alert(
    name="RLWatchEntropyFloorTest", severity="warning", for_steps=1, params=("entropy_floor_test",),
    summary="Entropy below a floor.", description="Run {{ $labels.run }}: entropy {{ $value }}.",
    windows="Entropy below `entropy_floor_test`.",
    condition=lambda h: one(h.latest("entropy_mean"), (h.latest("entropy_mean") or 1) < h.p("entropy_floor_test"),
                            (h.latest("entropy_mean") or 1) < h.p("entropy_floor_test")),
    runbook=Runbook(meaning="m", causes=["c"], look=["l"], do=["d"]),
    example=StepExample(series=with_step(3, entropy_mean={(): [1.0, 0.1, 0.1]}), fires_at=1, labels={}, value=0.1),
)

ALERTS = (ENTROPY_FLOOR,)
'''

PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import rlwatch.alerts.domains as domains
    domains.__path__.insert(0, sys.argv[1])      # the edited staleness.py shadows the shipped one
    from rlwatch.alerts import catalogue, params, render
    from rlwatch.alerts.evaluator import AlertEvaluator
    from rlwatch.postmortem import analysis

    def fired(alert_name, overrides=()):
        alert = catalogue.BY_NAME[alert_name]
        evaluator = AlertEvaluator("r1", watchdog_interval=0, overrides=dict(overrides))   # the whole catalogue
        at = None
        for step, values in alert.example.steps():
            evaluator.on_step(step, values)
            names = [e.name for e in evaluator.firing()]
            if alert_name in names and at is None:
                at = step
        evaluator.close()
        return at

    try:
        params.validate_overrides({"lag_high_max": 0.0})
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    render.write(Path(sys.argv[2]))
    print(json.dumps(dict(
        names=[a.name for a in catalogue.ALERTS], params=list(params.PARAMS),
        accepted=params.validate_overrides({"lag_high_max": 5}), refused=refused,
        rules=render.rules_yaml(), runbook=render.runbook_md(), tests=render.promtool_tests_yaml(),
        fired_at=fired("RLWatchVersionLagHigh"), fired_overridden=fired("RLWatchVersionLagHigh", {"lag_high_max": 50}),
        new_domain_fired_at=fired("RLWatchEntropyFloorTest"),
        lag=list(analysis.LAG_ALERTS), mismatch=sorted(analysis.MISMATCH_ALERTS), kl=list(analysis.KL_ALERTS))))
""")


def edited_staleness() -> str:
    """staleness.py with the one edit a contributor makes: the threshold, the alert, its place in ALERTS."""
    source = (DOMAINS / "staleness.py").read_text()
    head = "PARAMS: dict[str, Param] = {\n"
    listed = "ALERTS: tuple[Alert, ...] = (STALENESS_BOUND_EXCEEDED, VERSION_LAG_FAR_ABOVE_BOUND)"
    assert source.count(head) == 1 and source.count(listed) == 1, "staleness.py's declarations moved: update the test"
    source = source.replace(head, head + NEW_PARAM)
    return source.replace("#: The domain's alerts", NEW_ALERT + "#: The domain's alerts").replace(
        listed, listed[:-1] + ", VERSION_LAG_HIGH)")


@pytest.fixture(scope="module")
def added(tmp_path_factory) -> tuple[dict, Path]:
    domains, out = tmp_path_factory.mktemp("domains"), tmp_path_factory.mktemp("alerts")
    (domains / "staleness.py").write_text(edited_staleness())
    (domains / "zz_test_domain.py").write_text(NEW_DOMAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", PROBE, str(domains), str(out)], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), out


def test_an_alert_added_in_its_domain_module_is_in_the_catalogue_and_every_rendered_file(added):
    info, _ = added
    names = info["names"]
    # In page order: right after the staleness domain's other alerts; the new domain after the declared ones.
    assert names[names.index("RLWatchVersionLagFarAboveBound") + 1] == "RLWatchVersionLagHigh"
    assert names[-1] == "RLWatchEntropyFloorTest"
    assert "alert: \"RLWatchVersionLagHigh\"" in info["rules"] and "alert: \"RLWatchEntropyFloorTest\"" in info["rules"]
    assert "## RLWatchVersionLagHigh" in info["runbook"]
    assert "- `lag_high_max` = 3 (allowed: [1, inf)): Maximum version lag above which" in info["runbook"]
    assert "RLWatchVersionLagHigh (a step every 1s)" in info["tests"]


def test_its_threshold_is_declared_next_to_it_and_checked_like_every_other(added):
    info, _ = added
    params = info["params"]
    assert "lag_high_max" in params and "entropy_floor_test" in params
    assert params.index("lag_high_max") < params.index("length_bias_max")     # the staleness domain's place
    assert info["accepted"] == {"lag_high_max": 5.0}
    assert "'lag_high_max'=0.0 is not allowed: lag_high_max must be a number in [1, inf)" in info["refused"]


def test_the_in_process_evaluator_fires_it_on_its_example_and_reads_its_threshold(added):
    info, _ = added
    assert info["fired_at"] == 4
    assert info["fired_overridden"] is None                  # lag 7 stays below an overridden lag_high_max=50
    assert info["new_domain_fired_at"] == 1


def test_its_role_puts_it_in_the_post_mortems_lists(added):
    info, _ = added
    assert "RLWatchVersionLagHigh" in info["lag"] and "RLWatchVersionLagHigh" in info["mismatch"]
    assert "RLWatchVersionLagHigh" not in info["kl"] and "RLWatchEntropyFloorTest" not in info["mismatch"]


def test_promtool_fires_the_added_alert_on_its_example(added):
    """The rendered rules and promtool tests, with the added alerts, pass promtool."""
    promtool = need_binary("promtool")
    _, out = added
    result = subprocess.run([promtool, "test", "rules", "rlwatch-rules.test.yaml"], cwd=out, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RLWatchVersionLagHigh" in (out / "rlwatch-rules.yaml").read_text()


def test_without_the_edit_none_of_it_is_there():
    from rlwatch.alerts import catalogue, params
    from rlwatch.postmortem import analysis

    assert "RLWatchVersionLagHigh" not in catalogue.BY_NAME and "lag_high_max" not in params.PARAMS
    assert "RLWatchVersionLagHigh" not in analysis.LAG_ALERTS
