"""Where the rules' runbook links point (no server started): the stack's own runbook server by default,
a team's copy when a runbook URL is configured at `rlwatch up` or render time."""

from __future__ import annotations

import re

from rlwatch.runs import resources
from rlwatch.alerts import render
from rlwatch.alerts.catalogue import ALERTS
from rlwatch.runs.stack import RUNBOOK_PORT, StackConfig, write_configs


def test_the_stack_links_its_rules_to_its_own_runbook_server(tmp_path, monkeypatch):
    monkeypatch.delenv("RLWATCH_RUNBOOK_URL", raising=False)
    cfg = StackConfig(tmp_path / "stack", runbook_port=19097)
    assert cfg.serves_runbook and StackConfig(tmp_path / "d").runbook_port == RUNBOOK_PORT
    write_configs(cfg)
    rules = (cfg.directory / render.RULES_FILE).read_text()
    links = re.findall(r'runbook_url: "([^"]+)"', rules)
    assert len(links) == len(ALERTS) and all(link.startswith("http://127.0.0.1:19097/#") for link in links)
    site = (cfg.runbook_site / "index.html").read_text()              # what the server serves at /
    assert site == resources.runbook_html()
    assert all(f'id="{link.split("#", 1)[1]}"' in site for link in links)
    assert (cfg.runbook_site / render.RUNBOOK_FILE).read_text() == render.runbook_md()


def test_a_team_hosted_copy_replaces_the_stack_runbook_server(tmp_path, monkeypatch):
    monkeypatch.delenv("RLWATCH_RUNBOOK_URL", raising=False)
    team = StackConfig(tmp_path / "opt", runbook_url="https://wiki.example/rl/runbook")       # --runbook-url
    assert not team.serves_runbook
    write_configs(team)
    assert "https://wiki.example/rl/runbook#rlwatchklspike" in (team.directory / render.RULES_FILE).read_text()
    monkeypatch.setenv("RLWATCH_RUNBOOK_URL", "https://team.example/rb")                      # the variable
    env = StackConfig(tmp_path / "env")
    assert not env.serves_runbook and env.runbook_base() == "https://team.example/rb"
    # at render time, for rules a team deploys itself
    assert render.main(["--dir", str(tmp_path / "mine"), "--runbook-url", "https://wiki.example/x"]) == 0
    assert "https://wiki.example/x#rlwatchklspike" in (tmp_path / "mine" / render.RULES_FILE).read_text()
