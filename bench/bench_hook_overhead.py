"""The hook's cost on the training thread for a large step (B=512, T=2048) with every exporter on:
the /metrics endpoint (scraped concurrently), the run store, OpenTelemetry, a Pushgateway (when the
binary is installed), the in-process alert evaluator with a webhook notifier, and the reward-hack
detectors on 512 episodes. Between two observes the "trainer" sleeps ``--step-seconds`` (a GPU
trainer's CPU mostly waits too), during which rlwatch's background threads (store writer, hack
detectors, notifier, pushes, scrapes) do their work. Printed next to the median step time of the
tiny TRL GRPO run on CPU, measured in the same process.

    python bench/bench_hook_overhead.py [--steps 20] [--step-seconds 0.5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rlwatch  # noqa: E402
from rlwatch.alerts.notify import WebhookNotifier  # noqa: E402

from bench.bench_signals import make_inputs  # noqa: E402


class _Sink(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trl_step_seconds(directory: str, steps: int = 6) -> float | None:
    """Median optimizer-step time of the tiny offline TRL GRPO run (tests/_trl_tiny.py), no hook."""
    try:
        from transformers import TrainerCallback

        from tests._trl_tiny import build_tiny_model, make_trainer
    except ImportError:
        return None
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

    trainer = make_trainer(build_tiny_model(directory), Path(directory) / "out", max_steps=steps,
                           callbacks=[Timer()])
    trainer.train()
    return statistics.median(times[1:]) if len(times) > 1 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--B", type=int, default=512)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    args = parser.parse_args()
    inputs = make_inputs(args.B, args.T)
    episodes = [{"env": e, "reward": float(r), "response": "an answer " * 20, "true_pass": bool(i % 3)}
                for i, (e, r) in enumerate(zip(inputs["env"], inputs["rewards"].tolist()))]
    sink = HTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    tmp = tempfile.mkdtemp()
    gateway = None
    if shutil.which("prometheus-pushgateway"):
        port = free_port()
        gateway = subprocess.Popen(["prometheus-pushgateway", f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    exporters = ["/metrics (scraped every 0.5 s)", "run store", "OpenTelemetry", "alert evaluator + webhook",
                 "hack detectors (512 episodes/step)"]
    if gateway:
        exporters.append("Pushgateway (every 1 s)")
    try:
        watch = rlwatch.Watch(run="overhead", port=0, store=f"{tmp}/s.db", otel=provider,
                              pushgateway=f"http://127.0.0.1:{port}" if gateway else None, push_interval=1.0,
                              notifiers=(WebhookNotifier(f"http://127.0.0.1:{sink.server_address[1]}/hook"),))
        stop = threading.Event()

        def scrape() -> None:
            while not stop.wait(0.5):
                urllib.request.urlopen(watch.url, timeout=5).read()
        threading.Thread(target=scrape, daemon=True).start()
        watch.observe(0, **inputs, episodes=episodes)                       # warm-up
        observe = []
        bare, bare_watch = [], rlwatch.Watch(run="bare", port=None, store=None, alerts=False)
        for step in range(1, args.steps + 1):
            time.sleep(args.step_seconds)                                    # the trainer's own step
            start = time.perf_counter()
            watch.observe(step, **inputs, episodes=episodes)
            observe.append(time.perf_counter() - start)
            time.sleep(args.step_seconds)
            start = time.perf_counter()
            bare_watch.observe(step, **inputs)                               # signals only, for reference
            bare.append(time.perf_counter() - start)
        bare_watch.close()
        stop.set()
        watch.close()
        trl = trl_step_seconds(tmp)
    finally:
        if gateway:
            gateway.terminate()
            gateway.wait(timeout=10)
        sink.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    observe.sort()
    print(f"B={args.B} T={args.T}, {args.steps} steps, exporters: {', '.join(exporters)}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"  Watch.observe on the training thread, every exporter on: median "
          f"{statistics.median(observe) * 1e3:.1f} ms, max {observe[-1] * 1e3:.1f} ms")
    print(f"  the same with no exporter (signals only):              median {statistics.median(bare) * 1e3:.1f} ms")
    if trl:
        print(f"  tiny TRL GRPO CPU run, median step: {trl * 1e3:.1f} ms (the hook's own share there is "
              f"measured by bench/bench_trl_overhead.py)")


if __name__ == "__main__":
    main()
