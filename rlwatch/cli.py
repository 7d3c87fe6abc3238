"""The ``rlwatch`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _cmd_up(args: argparse.Namespace) -> int:
    from .stack import StackConfig, StackError, up

    cfg = StackConfig(directory=Path(args.dir).resolve(), addr=args.addr, prometheus_port=args.prometheus_port,
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
    print(f"scraping {', '.join(cfg.targets)} and exporters registered in {cfg.sd_dir} "
          f"(Watch(sd_dir=...) or RLWATCH_SD_DIR); stop with: rlwatch down --dir {cfg.directory}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from .stack import down

    stopped = down(Path(args.dir).resolve())
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlwatch", description="Health signals for RL post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start a local Prometheus + Alertmanager (+ Grafana) with rlwatch's rules")
    p.add_argument("--dir", default=".rlwatch-stack", help="where configs, data and logs go")
    p.add_argument("--addr", default="127.0.0.1", help="bind address of the servers")
    p.add_argument("--prometheus-port", type=int, default=9090)
    p.add_argument("--alertmanager-port", type=int, default=9093)
    p.add_argument("--grafana-port", type=int, default=3000)
    p.add_argument("--target", action="append", help="host:port to scrape (repeatable; default 127.0.0.1:9400-9407)")
    p.add_argument("--webhook", help="deliver every alert to this webhook URL")
    p.set_defaults(func=_cmd_up)

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
