"""Load: many steps with many environment labels while a client scrapes /metrics every second.

Reports the steps stored, peak and final resident memory, the exposition size over time, and the
scrape latency (median, p99). Used by tests/test_load.py and runnable alone:

    python bench/load_test.py --steps 100000 --envs 1000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlwatch  # noqa: E402
from rlwatch.runs.store import StoreReader  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def records(count: int, envs: int, B: int = 8, T: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T)[None] < lengths[:, None]
        sampler = -torch.rand(B, T, generator=g) * 3
        out.append(dict(mask=mask, sampler_logp=sampler, trainer_logp=sampler + 0.05 * torch.randn(B, T, generator=g),
                        seq_version=torch.full((B,), 5) - torch.randint(0, 3, (B,), generator=g), trainer_version=5,
                        rewards=torch.randint(0, 2, (B,), generator=g).float(), group_ids=torch.arange(B) // 4,
                        truncated=lengths == T, env=[f"env-{rng.randrange(envs)}" for _ in range(B)]))
    return out


class Scraper(threading.Thread):
    def __init__(self, url: str, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.latencies: list[float] = []
        self.sizes: list[int] = []
        self.rss: list[float] = []
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            start = time.perf_counter()
            try:
                body = urllib.request.urlopen(self.url, timeout=10).read()
                self.latencies.append(time.perf_counter() - start)
                self.sizes.append(len(body))
            except Exception:  # noqa: BLE001
                self.errors += 1
            self.rss.append(rss_mib())


def run(steps: int, envs: int, directory: str) -> dict:
    pool = records(200, envs)
    path = os.path.join(directory, "load.db")
    baseline = rss_mib()
    started = time.perf_counter()
    with rlwatch.Watch(run="load", port=0, store=path) as watch:
        scraper = Scraper(watch.url)
        scraper.start()
        for step in range(steps):
            watch.observe(step, **pool[step % len(pool)])
        watch.flush(timeout=120)
        scraper.stop.set()
        scraper.join()
        final_text = urllib.request.urlopen(watch.url).read().decode()
        dropped = watch.store.dropped
    elapsed = time.perf_counter() - started
    with StoreReader(path) as store:
        stored = [r.step for r in store.steps("load")]
    # Per-environment counters keep every label seen (the step's gauges only this step's labels).
    env_series = [line for line in final_text.splitlines() if line.startswith("rlwatch_episodes_total{")]
    lat = sorted(scraper.latencies)
    tenth = max(1, len(scraper.rss) // 10)
    return {
        "steps": steps, "envs": envs, "seconds": round(elapsed, 1), "ms_per_step": round(elapsed / steps * 1e3, 3),
        "stored_steps": len(stored), "contiguous": stored == list(range(steps)), "store_dropped": dropped,
        "rss_baseline_mib": round(baseline, 1), "rss_peak_mib": round(max(scraper.rss, default=baseline), 1),
        "rss_early_mib": round(statistics.mean(scraper.rss[:tenth]), 1) if scraper.rss else None,
        "rss_late_mib": round(statistics.mean(scraper.rss[-tenth:]), 1) if scraper.rss else None,
        "exposition_bytes_first": scraper.sizes[0] if scraper.sizes else None,
        "exposition_bytes_max": max(scraper.sizes, default=None), "env_series": len(env_series),
        "scrapes": len(lat), "scrape_errors": scraper.errors,
        "scrape_ms_median": round(statistics.median(lat) * 1e3, 2) if lat else None,
        "scrape_ms_p99": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 2) if lat else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--envs", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        print(json.dumps(run(args.steps, args.envs, directory), indent=2))


if __name__ == "__main__":
    main()
