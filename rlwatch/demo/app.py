"""``rlwatch demo``: a real tiny RL run that collapses, watched live, then explained.

Trains the scenario engine (:mod:`rlwatch.demo.scenario`) with rlwatch attached: ``/metrics`` is
served, the run store and checkpoints go to a directory it names, a live terminal view shows the
signals, the run's health and the alerts as they fire, and the run ends with the post-mortem.
``--with-prometheus`` starts a real local Prometheus and Alertmanager (``rlwatch up``) that scrape
the run with rlwatch's rules, and shows what they fired and every notification Alertmanager sent
(to a webhook receiver of the demo's own on loopback).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HEADLINE = [("heldout_true_reward", "held-out true reward", "{:.2f}"), ("mismatch_kl_k3", "k3", "{:.4f}"),
            ("mismatch_abs_log_ratio_p99", "|Δlogp| p99", "{:.3f}"), ("is_ess_ratio", "ESS", "{:.3f}"),
            ("version_lag_max", "max lag", "{:.0f}"), ("is_tis_high_ratio", "w > C", "{:.1%}"),
            ("entropy_mean", "entropy", "{:.3f}")]
#: With --with-prometheus, each step waits this long so that the 1 s scrapes see every few steps.
PROMETHEUS_PACE_S = 0.5
#: The demo's own thresholds on top of WATCH_CONFIG (which the toy acceptance matrix also replays).
#: Each prompt has one right answer, so a policy that learns it becomes nearly deterministic: the mean
#: token entropy of every scenario, healthy first, falls below the shipped 20% of its maximum (measured
#: with seeds 0-3: healthy to 1.6-2.6% of it; at seed 0 the lowest of the nine scenarios, hack, to 1.3%).
#: No scenario's fault is an entropy collapse, so the demo sets the ratio below all of them; a run of
#: yours keeps the shipped 0.2.
DEMO_ALERT_OVERRIDES = {"entropy_collapse_ratio": 0.005}
#: Seconds the hack scenario waits, at most, for one step's reward-hack verdicts before the next step.
DETECTOR_WAIT_S = 30.0
#: After the run, how long the demo waits for Alertmanager to send every resolution: the shipped
#: rules keep an alert firing 1 m after its condition clears (keep_firing_for), then Prometheus'
#: resend delay and Alertmanager's group interval.
RESOLVE_TIMEOUT_S = 100.0
RESOLVE_WAIT_NOTE = "1 m after its condition clears"


class LiveView:
    """A rich live panel (plain lines when rich is not installed or not a terminal): the signals, a
    "firing now" list of every open alert, and one line per alert transition (firing or resolved)."""

    def __init__(self, scenario: str, steps: int, url: str | None, enabled: bool = True) -> None:
        self.scenario, self.steps, self.url = scenario, steps, url
        self.values: dict[str, float] = {}
        self.alerts: list[str] = []
        self.firing: list = []
        self.opened: dict[tuple, int | None] = {}      # (name, labels) -> the step the alert opened at
        self.health = "healthy"
        self.step = 0
        self._live = None
        if enabled:
            try:
                from rich.console import Console
                from rich.live import Live

                console = Console()
                if console.is_terminal:
                    self._live = Live(self._render(), console=console, refresh_per_second=4)
                    self._live.start()
            except ImportError:
                pass

    def _render(self) -> Any:
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        colour = {"healthy": "green", "warning": "yellow", "critical": "red"}[self.health]
        grid = Table.grid(padding=(0, 2))
        grid.add_row(f"[bold]{self.scenario}[/bold]  step {self.step}/{self.steps}",
                     ProgressBar(total=self.steps, completed=self.step, width=40),
                     f"[bold {colour}]{self.health.upper()}[/]")
        signals = Table(show_header=True, header_style="bold")
        for _, label, _ in HEADLINE:
            signals.add_column(label)
        signals.add_row(*[fmt.format(self.values[k]) if k in self.values else "-" for k, _, fmt in HEADLINE])
        firing = "\n".join(self.firing_line(e) for e in self.firing) or "nothing"
        transitions = "\n".join(self.alerts[-6:]) or "no alert yet"
        body = Table.grid()
        body.add_row(grid)
        body.add_row(signals)
        body.add_row(f"[bold]firing now[/bold]\n{firing}")
        body.add_row(f"[bold]transitions[/bold]\n{transitions}")
        if self.url:
            body.add_row(f"[dim]metrics: {self.url}[/dim]")
        return Panel(body, title="rlwatch demo")

    @staticmethod
    def _key(event: Any) -> tuple:
        return event.name, tuple(sorted(event.labels.items()))

    def firing_line(self, event: Any) -> str:
        """An open alert: name, severity, labels, latest value and the step it opened at."""
        labels = "".join(f" {k}={v}" for k, v in sorted(event.labels.items()))
        value = "" if event.value is None else f": {event.value_text}"
        opened = self.opened.get(self._key(event), event.step)
        return f"{event.name} ({event.severity}){labels}{value} since step {opened}"

    def update(self, step: int, values: dict[str, float], firing: list) -> None:
        self.step = step + 1
        self.values.update(values)
        self.firing = sorted(firing, key=lambda e: (e.severity != "critical", e.name))
        severities = {e.severity for e in firing}
        self.health = "critical" if "critical" in severities else ("warning" if "warning" in severities else "healthy")
        if self._live is not None:
            self._live.update(self._render())
        elif step % 10 == 0 or step == self.steps - 1:
            shown = ", ".join(f"{label} " + fmt.format(self.values[k]) for k, label, fmt in HEADLINE
                              if k in self.values)
            now = ", ".join(e.name.removeprefix("RLWatch") + "".join(f" {k}={v}" for k, v in sorted(e.labels.items()))
                            for e in self.firing) or "nothing"
            print(f"step {step:3d} [{self.health}] {shown}; firing now: {now}", flush=True)

    def alert(self, event: Any) -> None:
        """One line per transition (the evaluator emits each transition once)."""
        labels = "".join(f" {k}={v}" for k, v in sorted(event.labels.items()))
        value = "" if event.value is None else f": {event.value_text}"
        line = f"step {event.step}: {event.state.upper()} {event.name} ({event.severity}){labels}{value}"
        if event.state == "firing":
            self.opened[self._key(event)] = event.step
        self.alerts.append(line)
        if self._live is None:
            print(line, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()


class WebhookReceiver:
    """Alertmanager's webhook receiver on 127.0.0.1: ``notifications`` holds one (receiver, alert name,
    run, status, the alert's labels as JSON) per alert of every notification, in arrival order."""

    def __init__(self) -> None:
        self.notifications: list[tuple[str, str, str, str, str]] = []
        received = self.notifications

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                    received.extend((body.get("receiver", ""), a["labels"].get("alertname", ""),
                                     a["labels"].get("run", ""), a.get("status", ""),
                                     json.dumps(a["labels"], sort_keys=True)) for a in body["alerts"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    pass
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, name="rlwatch-demo-webhook", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _prometheus_stack(directory: Path) -> tuple[Any, dict[str, dict], WebhookReceiver]:
    """Start the demo's stack: (its StackConfig, what ``up`` started, the webhook receiver it notifies)."""
    from ..runs.stack import StackConfig, StackError, find_binary, up

    if not (find_binary("prometheus") and find_binary("prometheus-alertmanager", "alertmanager")):
        raise StackError("--with-prometheus needs the prometheus and prometheus-alertmanager binaries: "
                         "sudo apt-get install -y --no-install-recommends prometheus prometheus-alertmanager")
    # The demo's Watch registers in cfg.sd_dir; every notification is sent at once to the demo's webhook.
    receiver = WebhookReceiver()
    cfg = StackConfig(directory=directory, scrape_interval="1s", webhook=receiver.url, group_wait="1s",
                      group_interval="2s")
    import socket

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    cfg.prometheus_port, cfg.alertmanager_port, cfg.runbook_port = free(), free(), free()
    try:
        return cfg, up(cfg), receiver
    except BaseException:
        receiver.close()
        raise


def _stop_stack(stack: tuple[Any, dict[str, dict], WebhookReceiver]) -> None:
    from ..runs.stack import down

    try:
        down(stack[0].directory)
    finally:
        stack[2].close()


def _get_json(url: str) -> Any:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def _wait_scraped(prometheus_url: str, target: str, timeout: float = 30.0) -> bool:
    """True once Prometheus has scraped ``target`` successfully (so the run's first steps are seen)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            targets = _get_json(f"{prometheus_url}/api/v1/targets")["data"]["activeTargets"]
            if any(t["scrapeUrl"].startswith(f"http://{target}/") and t["health"] == "up" for t in targets):
                return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def _fired(prometheus_url: str, run: str) -> list[str]:
    """Alert names Prometheus fired for ``run`` at any time of the demo."""
    query = urllib.request.quote(f'max by (alertname) (max_over_time(ALERTS{{run="{run}",alertstate="firing"}}[1h]))')
    body = _get_json(f"{prometheus_url}/api/v1/query?query={query}")
    return sorted({r["metric"]["alertname"] for r in body["data"]["result"]})


def _delivered(receiver: WebhookReceiver, run: str, quiet: float = 4.0, timeout: float = 20.0,
               until_resolved: bool = False) -> dict[str, list]:
    """{alert name: [(receiver, status), ...]} of every notification about ``run`` (each incident's
    firing and resolution once), once none has come for ``quiet`` seconds (Alertmanager's last group
    intervals) and, with ``until_resolved``, every notified alert was also resolved; or after ``timeout``."""
    deadline, seen, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline and (time.monotonic() - since < quiet
                                           or until_resolved and _unresolved(receiver, run)):
        if len(receiver.notifications) != seen:
            seen, since = len(receiver.notifications), time.monotonic()
        time.sleep(0.2)
    delivered: dict[str, list] = {}
    counted: set[tuple] = set()
    for name_of_receiver, alertname, alert_run, status, *incident in list(receiver.notifications):
        if alert_run == run and (name_of_receiver, alertname, status, *incident) not in counted:
            counted.add((name_of_receiver, alertname, status, *incident))
            delivered.setdefault(alertname, []).append((name_of_receiver, status))
    return dict(sorted(delivered.items()))


def _unresolved(receiver: WebhookReceiver, run: str) -> bool:
    """Whether an alert of ``run`` was notified firing and not yet resolved (by its labels)."""
    last: dict[tuple, str] = {}
    for _, alertname, alert_run, status, *incident in list(receiver.notifications):
        if alert_run == run:
            last[(alertname, *incident)] = status
    return any(status == "firing" for status in last.values())


def run_demo(scenario: str = "collapse", steps: int | None = None, seed: int = 0, port: int | None = 9400,
             out: str = "rlwatch-demo", with_prometheus: bool = False, live: bool = True) -> dict:
    """Run one scenario with rlwatch attached; returns the post-mortem document."""
    from ..alerts.notify import quiet_alert_log
    from ..hook.watch import Watch
    from ..postmortem import run_postmortem
    from ..postmortem.probe import ROLLOUTS_FILE
    from . import WATCH_CONFIG, checkpoint  # noqa: F401 - checkpoint: the probe's loader of its checkpoints
    from .scenario import SCENARIOS, save_probe_rollouts

    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    config = SCENARIOS[scenario]
    config = replace(config, seed=seed, **({"steps": steps} if steps else {}))
    directory = Path(out) / f"{scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    directory.mkdir(parents=True, exist_ok=True)
    run = f"demo-{scenario}"
    stack = urls = prometheus_alerts = delivered = None
    stack_pids: dict[str, int] = {}
    if with_prometheus:
        if not port:
            raise ValueError("--with-prometheus needs the metrics endpoint (a --port)")
        stack = _prometheus_stack(directory / "stack")
        urls = {name: info["url"] for name, info in stack[1].items()}
        stack_pids = {name: info["pid"] for name, info in stack[1].items()}
        print(f"Prometheus {urls['prometheus']}  Alertmanager {urls['alertmanager']}", flush=True)
    watch = Watch(run=run, port=port, port_fallback=True, store=str(directory / "run.db"), framework="rlwatch-demo",
                  metadata={"scenario": scenario, "correction": config.correction, "scenario_config": config.__dict__},
                  sd_dir=str(stack[0].sd_dir) if stack is not None else None, **demo_watch_config(WATCH_CONFIG))
    view = None
    try:
        with quiet_alert_log():       # the live view prints each transition itself
            if stack is not None and not _wait_scraped(urls["prometheus"], f"127.0.0.1:{watch.port}"):
                print("warning: Prometheus has not scraped the demo yet; its first steps may be missed", flush=True)
            view = LiveView(scenario, config.steps, watch.url, enabled=live)
            watch.on_alert(view.alert)
            result = _train(watch, view, config, scenario, directory, paced=stack is not None)
            if stack is not None:
                prometheus_alerts, delivered = _what_the_stack_did(stack, urls["prometheus"], watch, run)
    finally:
        if view is not None:
            view.close()
        watch.close()
        if stack is not None:
            _stop_stack(stack)
    save_probe_rollouts(str(directory / ROLLOUTS_FILE), config)      # for `rlwatch postmortem RUN --probe`
    document = run_postmortem(str(directory / "run.db"), out_dir=str(directory / "report"))
    collapse = document["collapse_step"]          # the post-mortem's dating of the stored held-out reward
    _print_summary(document, collapse, directory, result.seconds, prometheus_alerts, delivered)
    document["demo"] = {"directory": str(directory), "collapse_step": collapse, "seconds": result.seconds,
                        "prometheus_alerts": prometheus_alerts,
                        "alertmanager_alerts": None if delivered is None else list(delivered),
                        "alertmanager_notifications": delivered, "stopped_servers": stack_pids}
    (directory / "demo.json").write_text(json.dumps(document["demo"], indent=2))
    return document


def demo_watch_config(config: dict) -> dict:
    """``config`` (WATCH_CONFIG) with :data:`DEMO_ALERT_OVERRIDES` added to its alert overrides."""
    return {**config, "alert_overrides": {**config.get("alert_overrides", {}), **DEMO_ALERT_OVERRIDES}}


def _what_the_stack_did(stack: tuple, prometheus_url: str, watch: Any, run: str) -> tuple[list[str], dict]:
    """After the run: what Prometheus fired, then (the run's exporter closed, so its alerts resolve)
    every notification Alertmanager sent, resolutions included."""
    time.sleep(3.0)                       # the last step's scrape and rule evaluation
    fired = _fired(prometheus_url, run)
    watch.close()
    print(f"Waiting for Alertmanager's resolutions (each rule keeps firing {RESOLVE_WAIT_NOTE}; at most "
          f"{RESOLVE_TIMEOUT_S:.0f} s) ...", flush=True)
    return fired, _delivered(stack[2], run, timeout=RESOLVE_TIMEOUT_S, until_resolved=True)


def _train(watch: Any, view: LiveView, config: Any, scenario: str, directory: Path, paced: bool) -> Any:
    """Train the scenario with ``watch`` observing every step (the episodes too, for "hack") and
    ``view`` showing it; ``paced`` waits :data:`PROMETHEUS_PACE_S` per step for the scrapes."""
    from .scenario import run_scenario

    def on_step(info: Any) -> None:
        values = watch.observe(info.step, **info.fields,
                               **({"episodes": info.episodes} if scenario == "hack" else {}))
        if watch.hacks is not None:
            # The toy's steps take milliseconds, a real one's minutes: wait for this step's verdicts (the
            # detectors run in their own process) so that they reach the next step, as in a real run,
            # whatever the machine's load.
            watch.hacks.flush(timeout=DETECTOR_WAIT_S)
        watch.log_scalars(info.step, info.metrics)
        shown = {k: v for k, v in info.metrics.items() if isinstance(v, (int, float))}
        for key, _, _ in HEADLINE:
            v = (values or {}).get(key, {}).get(())
            if v is not None:
                shown[key] = v
        view.update(info.step, shown, watch.evaluator.firing() if watch.evaluator else [])
        if paced:
            time.sleep(PROMETHEUS_PACE_S)     # let the 1 s scrapes see the run step by step

    return run_scenario(config, on_step=on_step, checkpoint_dir=str(directory / "checkpoints"),
                        on_checkpoint=watch.record_checkpoint)


def _print_summary(document: dict, collapse: int | None, directory: Path, seconds: float,
                   prometheus_alerts: list[str] | None, delivered: dict[str, list] | None) -> None:
    """The demo's closing lines: the first critical alert against the collapse, the cause and the
    resume point, what a real Prometheus fired and Alertmanager sent, where the store and report are,
    and the commands to run next."""
    critical = [a for a in document["alerts"] if a["severity"] == "critical"]
    print()
    if collapse is not None and critical:
        first = min(critical, key=lambda a: a["step"])
        lead = collapse - first["step"]
        print(f"The critical alert {first['name']} fired at step {first['step']}, "
              + (f"{lead} steps before the collapse" if lead >= 0 else f"{-lead} steps after the collapse")
              + f" (held-out reward lost at step {collapse}"
              + (f"; {document['recovery']['text']}" if document.get("recovery") else "") + ").")
    elif collapse is not None:
        print(f"The run collapsed at step {collapse} and no critical alert fired.")
    else:
        print(f"No collapse in this run ({_count(len(critical), 'critical alert')}).")
    resume = document.get("resume") or {}
    explained = f" ({document['mismatch_explanation']})" if document.get("mismatch_explanation") else ""
    named = " + ".join(document.get("causes") or []) or document["cause"]
    checkpoint = (resume.get("checkpoint") or {}).get("path", "no checkpoint")
    print(f"Cause: {named}{explained}. Resume from: {checkpoint} ({resume.get('reason', 'no resume point')}).")
    if document.get("correction_held"):
        print(f"Held: {document['correction_held']}.")
    if prometheus_alerts is not None:
        sent = [f"{name} ({', '.join(f'{status} to {to}' for to, status in notes)})"
                for name, notes in (delivered or {}).items()]
        held = [name for name in prometheus_alerts if name not in (delivered or {})]
        print(f"Prometheus fired: {', '.join(prometheus_alerts) or 'nothing'}; "
              f"Alertmanager notified: {', '.join(sent) or 'nothing'}"
              + (f"; not notified (inhibited by the run's critical alerts, or resolved before Alertmanager's group "
                 f"wait): {', '.join(held)}" if held else ""))
    print(f"Run store {directory / 'run.db'}; report and plots in {directory / 'report'} "
          f"({seconds:.0f} s of training).")
    print(next_steps())


def next_steps(path: str | None = None) -> str:
    """What to run after the demo, and how to reach the ``rlwatch`` command when it is not on ``path``
    ($PATH): the virtual environment's activate script, else its directory."""
    scripts = Path(sys.executable).parent
    found = shutil.which("rlwatch", path=path)
    hint = ""
    if (scripts / "rlwatch").exists() and not (found and os.path.samefile(found, scripts / "rlwatch")):
        activate = scripts / "activate"
        hint = (f"`rlwatch` is not on your PATH: first run `source {activate}`" if activate.exists()
                else f"`rlwatch` is not on your PATH: first run `export PATH={scripts}:$PATH`") + "; then "
    return (f"Next: {hint}`rlwatch up` (a local Prometheus + Alertmanager that your runs register with), "
            f"and in another shell `rlwatch run -- python your_script.py` (a TRL, verl or OpenRLHF script; or "
            f"rlwatch.Watch in your loop).")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


__all__ = ["run_demo"]
