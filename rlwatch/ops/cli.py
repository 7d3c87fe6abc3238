"""The ``rlwatch`` command line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from ..core.config import OPTION_VARIABLES, REPORT_VARIABLE


def _cmd_up(args: argparse.Namespace) -> int:
    from ..runs.stack import StackConfig, StackError, up

    cfg = StackConfig(directory=Path(args.dir), addr=args.addr, prometheus_port=args.prometheus_port,
                      alertmanager_port=args.alertmanager_port, grafana_port=args.grafana_port,
                      webhook=args.webhook, scrape_interval=args.scrape_interval, runbook_url=args.runbook_url,
                      runbook_port=args.runbook_port)
    if args.target:
        cfg.targets = args.target
    try:
        started = up(cfg)
    except StackError as exc:
        print(f"rlwatch up: {exc}", file=sys.stderr)
        return 1
    for name, info in started.items():
        print(f"{name:<13} {info['url']}  (pid {info['pid']})")
    if "grafana" not in started:
        from ..runs.resources import root

        print(f"grafana       not started: no grafana-server on PATH; import the dashboards by hand "
              f"(Dashboards > New > Import): {root() / 'dashboards'}/*.json")
    from ..alerts.render import RUNBOOK_FILE

    served = "served by the stack until `rlwatch down`" if "runbook" in started else "your team's copy"
    print(f"alerts link to the runbook at {cfg.runbook_base()} ({served}; a copy: {cfg.directory / RUNBOOK_FILE})")
    static = f"{', '.join(cfg.targets)} and " if cfg.targets else ""
    print(f"scraping {static}the exporters registered in {cfg.sd_dir} every {cfg.scrape_interval}: every Watch "
          f"on this machine registers there by default (opt out: RLWATCH_SD_DIR=; on other nodes set RLWATCH_SD_DIR "
          f"to a directory this Prometheus reads); stop with: rlwatch down (from anywhere) or rlwatch down --dir "
          f"{cfg.directory}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from ..runs.stack import down, running, running_stacks, state_dir

    listed = f"{state_dir() / 'stacks'}"
    if args.all:
        stacks = running_stacks()
        default = Path(DEFAULT_STACK_DIR).resolve()
        if default not in stacks and running(default):
            stacks[default] = running(default)
        for directory in stacks:
            print(f"stopped {', '.join(down(directory))} (stack in {directory})")
        if not stacks:
            print(f"stopped: nothing was running (no stack in {default} nor listed in {listed})")
        return 0
    if args.dir is not None:
        directory = Path(args.dir).resolve()
    elif running(Path(DEFAULT_STACK_DIR).resolve()):
        directory = Path(DEFAULT_STACK_DIR).resolve()
    else:
        stacks = running_stacks()
        if len(stacks) > 1:
            print("rlwatch down: several stacks are running; pass --dir (or --all):\n" + "\n".join(
                f"  rlwatch down --dir {d}   ({', '.join(names)})" for d, names in stacks.items()), file=sys.stderr)
            return 1
        if not stacks:
            print(f"stopped: nothing was running (no stack in {Path(DEFAULT_STACK_DIR).resolve()} nor listed in "
                  f"{listed}; for a stack started with another RLWATCH_STATE_DIR, pass --dir)")
            return 0
        directory = next(iter(stacks))
    stopped = down(directory)
    if stopped:
        print(f"stopped {', '.join(stopped)} (stack in {directory})")
        return 0
    others = running_stacks()
    others.pop(directory, None)
    if others:
        print(f"rlwatch down: nothing was running from {directory}; running stacks:\n" + "\n".join(
            f"  rlwatch down --dir {d}   ({', '.join(names)})" for d, names in others.items()), file=sys.stderr)
        return 1
    print(f"stopped: nothing was running from {directory}")
    return 0


#: ``rlwatch run``'s options that reach the trainer's processes: option -> (type, help). Each travels in
#: the variable :data:`rlwatch.core.config.OPTION_VARIABLES` names (the help's ``{variable}``).
RUN_OPTIONS: dict[str, tuple[type, str]] = {
    "run": (str, "run name ({variable}; default: the trainer's own name)"),
    "port": (int, "metrics port ({variable}; default 9400, the next free one if taken)"),
    "addr": (str, "bind address ({variable}; default 127.0.0.1)"),
    "store": (str, "run-store path, or none for no store ({variable}; default: next to the checkpoints for TRL, "
                   "else rlwatch-runs/<run>.db)"),
    "sd_dir": (str, "Prometheus file_sd directory to register in ({variable}; default: that of the stack "
                    "`rlwatch up` started on this machine, if any; empty: none)"),
    "frameworks": (str, "comma list of trl,verl,openrlhf to hook (default: all)"),
}


def _cmd_run(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from .autoload import BOOTSTRAP_DIR, frameworks as registered
    from .child import run_command

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("rlwatch run: give the command after --, e.g. rlwatch run -- python your_script.py", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p and p != BOOTSTRAP_DIR])
    if args.store is not None and args.store.strip().lower() in ("none", "off", "0", ""):
        args.store = "none"                     # no store: RLWATCH_STORE=none (not a file named "none")
    for option, variable in OPTION_VARIABLES.items():
        value = getattr(args, option)
        if value is not None:
            env[variable] = str(value)
    if args.strict:
        env["RLWATCH_STRICT"] = "1"
    frameworks = args.frameworks or ",".join(registered())
    with tempfile.TemporaryDirectory(prefix="rlwatch-run-") as tmp:
        report_path = os.path.join(tmp, "report.jsonl")
        env[REPORT_VARIABLE] = report_path
        if not args.quiet:
            print(f"rlwatch run: watching supported trainers ({frameworks}) in every Python process of: "
                  f"{' '.join(command)}", file=sys.stderr, flush=True)
        try:
            code = run_command(command, env, lambda line: print(line, file=sys.stderr, flush=True))
        except FileNotFoundError:
            print(f"rlwatch run: command not found: {command[0]}", file=sys.stderr)
            return 127
        except OSError as exc:                    # a directory, a file without execute permission, ...
            print(f"rlwatch run: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 126
        events = _read_report(report_path)
        from ..runs.discovery import remove_if_dead

        remove_if_dead([str(e["path"]) for e in events if e.get("event") == "registered" and e.get("path")])
        if not args.quiet:
            print(_run_summary(events, frameworks), file=sys.stderr, flush=True)
    return code


def _read_report(path: str) -> list[dict]:
    """The run report's events, one JSON object a line (an unreadable line or a missing file: skipped)."""
    import json

    def parsed(line: str) -> dict | None:
        with contextlib.suppress(ValueError):
            return json.loads(line)
        return None

    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as handle:
        return [event for event in map(parsed, handle) if event is not None]
    return []


def _run_summary(events: list[dict], frameworks: str) -> str:
    """What ``rlwatch run`` says after the command: the runs it watched, or why nothing was watched."""
    watched: list[dict] = []
    for e in events:          # a Watch the script's own watch() replaced is not listed
        if e.get("event") == "replaced":
            watched = [w for w in watched if (w.get("pid"), w.get("run")) != (e.get("pid"), e.get("run"))]
        elif e.get("event") == "watching" and e.get("active", True):
            watched.append(e)
    announced = {(e.get("pid"), e.get("run")) for e in watched}
    own = [e for e in events if e.get("event") == "created" and (e.get("pid"), e.get("run")) not in announced]
    if watched or own:
        lines = []
        for e in watched + own:
            store = e.get("store")
            what = (f"watched {e['framework']} run {e['run']!r}" if e in watched
                    else f"the command's own rlwatch.Watch watched run {e['run']!r}")
            lines.append(f"rlwatch run: {what} (process {e['pid']}): metrics were at {e.get('url') or 'no endpoint'}, "
                         f"store {store or 'none'}" + (f" (rlwatch postmortem {store})" if store else ""))
        return "\n".join(lines)
    imported = sorted({f"{e['framework']} {e.get('version') or ''}".strip() for e in events
                       if e.get("event") == "imported"})
    unavailable = [e for e in events if e.get("event") == "unavailable"]
    if unavailable and not imported:
        e = unavailable[0]
        return (f"rlwatch run: nothing was instrumented: the command's Python ({e.get('python')}) cannot import "
                f"rlwatch ({e.get('error')}): install rlwatch-llm in that environment, or start the command with "
                f"{sys.executable}")
    if imported:
        why = (f"it imported {', '.join(imported)} but built no trainer that rlwatch supports (TRL GRPOTrainer, "
               f"verl's PPO trainers, OpenRLHF's PPO trainer), or a version outside the supported range "
               f"(see the warnings above)")
    else:
        why = f"no process of the command imported a supported framework ({frameworks})"
    return (f"rlwatch run: nothing was instrumented: {why}. In a custom training loop, create an "
            f"rlwatch.Watch and call observe() (README, Quick start).")


def _cmd_postmortem(args: argparse.Namespace) -> int:
    from ..demo import checkpoint  # noqa: F401 - registers the loader of the demo's checkpoints for --probe
    from ..postmortem import run_postmortem
    from ..postmortem.report import safe

    if args.baseline and args.baseline.startswith(("http://", "https://")) and not args.baseline_run:
        print("rlwatch postmortem: a Prometheus --baseline needs --baseline-run", file=sys.stderr)
        return 2
    try:
        run_postmortem(args.path, prometheus=args.prometheus, run=args.run, out_dir=args.out,
                       as_json=args.json, probe_file=args.probe, baseline=args.baseline,
                       baseline_run=args.baseline_run, since=args.since, run_instance=args.run_instance,
                       baseline_run_instance=args.baseline_run_instance, deadline=args.deadline,
                       probe_loader=args.probe_loader)
    except FileNotFoundError as exc:
        text = str(exc) if str(exc).startswith(("not found", "--probe")) else f"not found: {exc.filename or exc}"
        print(f"rlwatch postmortem: {safe(text)}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:       # PostmortemInputError and other unreadable inputs
        print(f"rlwatch postmortem: {safe(exc)}", file=sys.stderr)
        return 1
    return 0




def _cmd_demo(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [name for name in ("safetensors", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:       # checkpoints (safetensors) and the post-mortem's plots (matplotlib)
        print(f"rlwatch demo: needs {' and '.join(missing)}: pip install {' '.join(missing)} (rlwatch's report extra)",
              file=sys.stderr)
        return 1
    from ..demo.app import run_demo
    from ..runs.stack import StackError

    try:
        run_demo(args.scenario, steps=args.steps, seed=args.seed, port=args.port, out=args.out,
                 with_prometheus=args.with_prometheus, live=not args.no_live)
    except (StackError, ValueError) as exc:
        print(f"rlwatch demo: {exc}", file=sys.stderr)
        return 1
    return 0


DEFAULT_STACK_DIR = ".rlwatch-stack"


def _cmd_files(args: argparse.Namespace) -> int:
    from ..runs import resources

    try:
        base = resources.root()
    except FileNotFoundError as exc:
        print(f"rlwatch files: {exc}", file=sys.stderr)
        return 1
    if args.copy:
        try:
            copied = resources.copy_to(args.copy, force=args.force)
        except resources.WouldOverwrite as exc:
            print(f"rlwatch files: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"rlwatch files: cannot copy into {args.copy}: {exc.strerror or exc}"
                  + (f" ({exc.filename})" if exc.filename else ""), file=sys.stderr)
            return 1
        for path in copied:
            print(f"copied {path}")
        return 0
    print(f"alert rules   {base / 'alerts' / 'rlwatch-rules.yaml'}")
    print(f"runbook       {base / 'alerts' / 'runbook.md'}  (also served by every exporter at /runbook)")
    print(f"alertmanager  {base / 'alerts' / 'alertmanager.example.yml'}")
    for path in resources.dashboards():
        print(f"dashboard     {path}")
    print(f"examples      {base / 'examples'}  (deploy/: docker-compose, Prometheus, Grafana, Kubernetes)")
    print("copy them all: rlwatch files --copy DIR")
    return 0


class _VersionAction(argparse.Action):
    """``--version``: one unwrapped line, the distribution, its version and the package's directory."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: object, values: object,
                 option_string: str | None = None) -> None:
        from .distribution import DIST_NAME, conflict_message, foreign_rlwatch, version

        print(f"{DIST_NAME} {version()} (import name rlwatch, {Path(__file__).resolve().parents[1]})")
        foreign = foreign_rlwatch()
        if foreign:
            print(f"rlwatch: warning: {conflict_message(foreign)}", file=sys.stderr)
        parser.exit()


def _command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], help: str,
             description: str | None = None) -> argparse.ArgumentParser:
    """The subcommand ``name``, which runs ``func(args)``; its options' defaults are shown in --help."""
    parser = sub.add_parser(name, help=help, description=description, formatter_class=_HelpFormatter)
    parser.set_defaults(func=func)
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already names its default or
    there is none to show (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" not in text and action.option_strings and action.default is not None
                and action.default is not False and action.default != argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _add_demo(sub: Any) -> None:
    """``rlwatch demo`` and its options."""
    p = _command(sub, "demo", _cmd_demo, "train a tiny RL policy that collapses, watched live, then explained",
                 "Train a tiny GRPO policy on CPU under a scenario (by default its sampler is 8 updates stale "
                 "and it collapses), serve its signals on /metrics, show the signals and alerts live, and end "
                 "with the post-mortem.")
    p.add_argument("--scenario", default="collapse",
                   help="collapse (lag 8), healthy, lag2, rescued (TIS), mis, hack, temperature_fault, "
                        "top_p_fault, partial")
    p.add_argument("--steps", type=int, help="training steps (default: the scenario's own)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the policy, prompts and sampling")
    p.add_argument("--port", type=int, default=9400, help="metrics port (the next free one if taken)")
    p.add_argument("--out", default="rlwatch-demo", help="directory for the run store, checkpoints and report")
    p.add_argument("--with-prometheus", action="store_true",
                   help="also run a real local Prometheus + Alertmanager with rlwatch's rules (Debian packages "
                        "prometheus, prometheus-alertmanager); steps are paced for its scrapes")
    p.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live terminal view")


def _add_up(sub: Any) -> None:
    """``rlwatch up`` and its options."""
    from ..runs.stack import RUNBOOK_PORT

    p = _command(sub, "up", _cmd_up, "start a local Prometheus + Alertmanager (+ Grafana) with rlwatch's rules",
                 "Start Prometheus and Alertmanager (and Grafana when grafana-server is on PATH) with rlwatch's "
                 "rules and dashboards, bound to --addr, in the background. Stop them with `rlwatch down` (from "
                 "any directory).")
    p.add_argument("--dir", default=DEFAULT_STACK_DIR, help="where configs, data, logs and PIDs go")
    p.add_argument("--addr", default="127.0.0.1", help="bind address of the servers")
    p.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus' port")
    p.add_argument("--alertmanager-port", type=int, default=9093, help="Alertmanager's port")
    p.add_argument("--grafana-port", type=int, default=3000, help="Grafana's port (when grafana-server is on PATH)")
    p.add_argument("--target", action="append", metavar="HOST:PORT",
                   help="a static exporter to scrape as well (repeatable; by default only the exporters "
                        "registered in DIR/targets are scraped)")
    p.add_argument("--scrape-interval", default="5s", help="Prometheus' scrape and rule evaluation interval")
    p.add_argument("--webhook", metavar="URL",
                   help="deliver every alert to this webhook URL (default: none, alerts stay in Alertmanager's UI)")
    p.add_argument("--runbook-url", metavar="URL",
                   help="base URL of the runbook the alerts link to, for a copy your team hosts (default: "
                        "$RLWATCH_RUNBOOK_URL, else the stack's own runbook server on --runbook-port)")
    p.add_argument("--runbook-port", type=int, default=RUNBOOK_PORT,
                   help="port of the stack's runbook server (started when no runbook URL is set; it outlives "
                        "the runs, so the alerts' links work after a run ended)")


def _add_down(sub: Any) -> None:
    """``rlwatch down`` and its options."""
    p = _command(sub, "down", _cmd_down, "stop what `rlwatch up` started",
                 f"Stop the servers `rlwatch up` started. Without --dir: the stack in ./{DEFAULT_STACK_DIR} if it "
                 "runs, else the one running stack listed in $RLWATCH_STATE_DIR (default ~/.local/state/rlwatch).")
    p.add_argument("--dir", default=None, help="the stack's directory (as given to rlwatch up)")
    p.add_argument("--all", action="store_true", help="stop every running stack")


def _add_run(sub: Any) -> None:
    """``rlwatch run`` and its options."""
    p = _command(sub, "run", _cmd_run, "run a training command with rlwatch attached (no code change)",
                 "Run COMMAND with rlwatch installed in every Python process it starts (and in its Ray workers): "
                 "supported trainers (TRL GRPOTrainer, verl, OpenRLHF) get a Watch automatically, which says "
                 "where its metrics and store are. Afterwards: what was watched, or why nothing was. Ctrl-C and "
                 "other signals reach COMMAND once and rlwatch run waits for it (Ctrl-C twice: stopped at once); "
                 "the exit status is COMMAND's (128+N when signal N ended it).")
    for option, (kind, text) in RUN_OPTIONS.items():
        p.add_argument("--" + option.replace("_", "-"), dest=option, type=kind,
                       help=text.format(variable=OPTION_VARIABLES[option]))
    p.add_argument("--strict", action="store_true", help="raise on rlwatch errors (tests)")
    p.add_argument("--quiet", action="store_true", help="no start and summary lines from rlwatch run itself")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")


def _add_postmortem(sub: Any) -> None:
    """``rlwatch postmortem`` and its options."""
    p = _command(sub, "postmortem", _cmd_postmortem, "explain a run: collapse, first changes, alerts, cause, "
                 "resume point, coverage, and divergence from a good run")
    p.add_argument("path", nargs="?", help="run store, TRL output directory or verl checkpoint directory")
    p.add_argument("--baseline", metavar="GOOD",
                   help="a good run to compare with, aligned by step: a run store, a TRL or verl output directory, "
                        "or a Prometheus URL (with --baseline-run)")
    p.add_argument("--baseline-run", help="run name in the baseline (stores with several runs, or Prometheus)")
    p.add_argument("--since", type=float, metavar="SECONDS",
                   help="Prometheus: search the last SECONDS for the run (default 7 days); every scrape of it is read")
    p.add_argument("--prometheus", help="query a live Prometheus instead (needs --run)")
    p.add_argument("--run", help="run name (stores with several runs, or --prometheus)")
    p.add_argument("--run-instance", metavar="ID", help="Prometheus: the process to read when several exported "
                   "the run name (its run_instance label, or instance where that is absent; listed when needed)")
    p.add_argument("--baseline-run-instance", metavar="ID", help="the same for a Prometheus --baseline")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help="seconds for the whole command: reading the run (every Prometheus answer, parsed, or a "
                        "store) and the analysis (default 120); past it, one line and exit 1")
    p.add_argument("--out", help="write postmortem.md, postmortem.json and PNG plots here")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the report")
    p.add_argument("--probe", nargs="?", const="auto", metavar="ROLLOUTS",
                   help="score every checkpoint on stored rollouts (safetensors); alone, the "
                        "rlwatch-probe-rollouts.safetensors next to the run (the TRL integration's output "
                        "directory, rlwatch demo's run directory)")
    p.add_argument("--probe-loader", metavar="MODULE:FUNCTION",
                   help="for --probe: FUNCTION(directory, config) returns logits(input_ids, attention_mask) for "
                        "checkpoints rlwatch has no loader for (built in: transformers, rlwatch demo)")


def _module_command(sub: Any, name: str, module: Any, help: str, description: str) -> None:
    """A command whose options and code live in ``module`` (``add_arguments``, ``run_command``)."""
    module.add_arguments(_command(sub, name, module.run_command, help, description))


def _add_whatif(sub: Any) -> None:
    """``rlwatch whatif`` and its options."""
    from ..whatif import command

    _module_command(sub, "whatif", command,
                    "simulate synchronous and asynchronous pipelines on a run's measured episode durations, "
                    "training and sync times",
                    "Feed the run's episode durations, training and weight-sync seconds to a discrete-event "
                    "pipeline simulation of synchronous, one-step-ahead and asynchronous designs (staleness bound "
                    "eta = 1, 2, 4, 8, partial rollouts or draining): throughput, slot utilisation, staleness and "
                    "trained episode duration next to the run's measured values, and a recommendation that reads "
                    "the run's mismatch by version lag. docs/whatif.md")


def _add_replay(sub: Any) -> None:
    """``rlwatch replay`` and its options."""
    from ..replay import command

    _module_command(sub, "replay", command,
                    "would rlwatch have caught it? the alerts and the post-mortem over a run's logged metrics, "
                    "no trainer needed",
                    "Feed each logged step of a run (TRL trainer_state.json, verl console or JSONL log, OpenRLHF log, "
                    "ms-swift logging.jsonl, W&B, TensorBoard or SwanLab CSV) to the alert evaluator at the shipped "
                    "thresholds: what would have fired and when, against the run's reward curve, then the "
                    "post-mortem. docs/replay.md")


def _add_files(sub: Any) -> None:
    """``rlwatch files`` and its options."""
    p = _command(sub, "files", _cmd_files, "where the shipped rules, runbook, dashboards and examples are")
    p.add_argument("--copy", metavar="DIR", help="copy alerts/, dashboards/ and examples/ into DIR")
    p.add_argument("--force", action="store_true",
                   help="with --copy: replace files in DIR that differ from the shipped ones (your edits)")


def build_parser() -> argparse.ArgumentParser:
    """The ``rlwatch`` parser: one subcommand per ``_add_*`` above, in the order --help lists them."""
    parser = argparse.ArgumentParser(
        prog="rlwatch", formatter_class=_HelpFormatter,
        description="Health signals for RL post-training of LLMs: a hook in the trainer exports them to "
                    "Prometheus, with alert rules, Grafana dashboards and a post-mortem.",
        epilog="Start with `rlwatch demo`; `rlwatch COMMAND --help` for a command's options.")
    parser.add_argument("--version", action=_VersionAction, help="print the version and where rlwatch is installed")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    _add_up(sub)
    _add_down(sub)
    _add_run(sub)
    _add_postmortem(sub)
    _add_whatif(sub)
    _add_replay(sub)
    _add_files(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:          # bare `rlwatch`
        parser.print_help()
        return 0
    from .distribution import conflict_message, foreign_rlwatch

    foreign = foreign_rlwatch()
    if foreign:
        print(f"rlwatch: warning: {conflict_message(foreign)}", file=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
