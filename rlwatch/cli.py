"""The ``rlwatch`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _cmd_up(args: argparse.Namespace) -> int:
    from .stack import StackConfig, StackError, up

    cfg = StackConfig(directory=Path(args.dir), addr=args.addr, prometheus_port=args.prometheus_port,
                      alertmanager_port=args.alertmanager_port, grafana_port=args.grafana_port,
                      webhook=args.webhook)
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
        print("grafana       not started: no grafana-server on PATH; import dashboards/*.json by hand "
              "(Dashboards > New > Import)")
    static = f"{', '.join(cfg.targets)} and " if cfg.targets else ""
    print(f"scraping {static}the exporters registered in {cfg.sd_dir}: export RLWATCH_SD_DIR={cfg.sd_dir} "
          f"(or Watch(sd_dir=...), rlwatch run --sd-dir) before training; stop with: rlwatch down --dir "
          f"{cfg.directory}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from .stack import down

    stopped = down(Path(args.dir).resolve())
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import os
    import subprocess

    from .autoload import BOOTSTRAP_DIR

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("rlwatch run: give the command after --, e.g. rlwatch run -- python train.py", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p and p != BOOTSTRAP_DIR])
    for option, variable in (("run", "RLWATCH_RUN"), ("port", "RLWATCH_PORT"), ("addr", "RLWATCH_ADDR"),
                             ("store", "RLWATCH_STORE"), ("sd_dir", "RLWATCH_SD_DIR"),
                             ("frameworks", "RLWATCH_FRAMEWORKS")):
        value = getattr(args, option)
        if value is not None:
            env[variable] = str(value)
    if args.strict:
        env["RLWATCH_STRICT"] = "1"
    try:
        return subprocess.call(command, env=env)
    except FileNotFoundError:
        print(f"rlwatch run: command not found: {command[0]}", file=sys.stderr)
        return 127


def _cmd_postmortem(args: argparse.Namespace) -> int:
    from .postmortem import run_postmortem

    try:
        run_postmortem(args.path, prometheus=args.prometheus, run=args.run, out_dir=args.out,
                       as_json=args.json, probe_file=args.probe)
    except (FileNotFoundError, ValueError) as exc:
        print(f"rlwatch postmortem: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo.app import run_demo
    from .stack import StackError

    try:
        run_demo(args.scenario, steps=args.steps, seed=args.seed, port=args.port, out=args.out,
                 with_prometheus=args.with_prometheus, live=not args.no_live)
    except (StackError, ValueError) as exc:
        print(f"rlwatch demo: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlwatch", description="Health signals for RL post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="train a tiny RL policy that collapses, watched live, then explained")
    p.add_argument("--scenario", default="collapse",
                   help="collapse (lag 8, default), healthy, lag2, rescued (TIS), mis, hack, temperature_fault, "
                        "top_p_fault, partial")
    p.add_argument("--steps", type=int, help="training steps (default: the scenario's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=9400, help="metrics port (the next free one if taken)")
    p.add_argument("--out", default="rlwatch-demo", help="directory for the run store, checkpoints and report")
    p.add_argument("--with-prometheus", action="store_true",
                   help="also run a real local Prometheus + Alertmanager with rlwatch's rules")
    p.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live view")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("up", help="start a local Prometheus + Alertmanager (+ Grafana) with rlwatch's rules")
    p.add_argument("--dir", default=".rlwatch-stack", help="where configs, data and logs go")
    p.add_argument("--addr", default="127.0.0.1", help="bind address of the servers")
    p.add_argument("--prometheus-port", type=int, default=9090)
    p.add_argument("--alertmanager-port", type=int, default=9093)
    p.add_argument("--grafana-port", type=int, default=3000)
    p.add_argument("--target", action="append", help="a static host:port to scrape as well (repeatable; by default only "
                   "exporters registered in <dir>/targets are scraped)")
    p.add_argument("--webhook", help="deliver every alert to this webhook URL")
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("run", help="run a training command with rlwatch attached (no code change)",
                       description="Run COMMAND with rlwatch installed in every Python process it starts "
                                   "(and in its Ray workers): supported trainers get a Watch automatically.")
    p.add_argument("--run", help="run name (RLWATCH_RUN)")
    p.add_argument("--port", type=int, help="metrics port (RLWATCH_PORT, default 9400 with fallback)")
    p.add_argument("--addr", help="bind address (RLWATCH_ADDR, default 127.0.0.1)")
    p.add_argument("--store", help="run-store path (RLWATCH_STORE)")
    p.add_argument("--sd-dir", dest="sd_dir", help="Prometheus file_sd directory to register in (RLWATCH_SD_DIR)")
    p.add_argument("--frameworks", help="comma list of trl,verl,openrlhf to hook (default all)")
    p.add_argument("--strict", action="store_true", help="raise on rlwatch errors (tests)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("postmortem", help="explain a run: collapse, first signals, alerts, cause, checkpoint")
    p.add_argument("path", nargs="?", help="run store, TRL output directory or verl checkpoint directory")
    p.add_argument("--prometheus", help="query a live Prometheus instead (needs --run)")
    p.add_argument("--run", help="run name (stores with several runs, or --prometheus)")
    p.add_argument("--out", help="write postmortem.md, postmortem.json and PNG plots here")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the report")
    p.add_argument("--probe", nargs="?", const="auto", metavar="ROLLOUTS",
                   help="score every checkpoint on stored rollouts (safetensors); alone, the "
                        "rlwatch-probe-rollouts.safetensors the TRL integration keeps in the output directory")
    p.set_defaults(func=_cmd_postmortem)

    p = sub.add_parser("down", help="stop what `rlwatch up` started")
    p.add_argument("--dir", default=".rlwatch-stack")
    p.set_defaults(func=_cmd_down)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
