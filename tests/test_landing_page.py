"""The exporter's page at ``/`` for a person: the headline signals' latest values, a held alert saying
how long it holds before it clears, a page that refreshes itself; checked over real HTTP and in a real
headless Chromium (skipped where no Chromium is installed; `make test` installs it)."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import rlwatch

from tests.conftest import make_step, need_binary


def _browser() -> str:
    """The headless browser: Chromium (Debian's `chromium`, which scripts/install-servers.sh installs
    for `make test`), else skipped (failed under RLWATCH_REQUIRE_SERVERS=1)."""
    found = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                  if shutil.which(name)), None)
    return found or need_binary("chromium")


def _held_watch() -> rlwatch.Watch:
    """A Watch whose KL spike opened (4 noisy steps) and whose condition then stopped holding (4 steps
    where sampler and trainer agree): RLWatchKLSpike holds 15 - 4 = 11 more steps before it clears."""
    watch = rlwatch.Watch(run="landing", port=0, store=None, alerts=True)
    for step in range(4):
        watch.observe(step, **make_step(seed=step, noise=1.0))
    for step in range(4, 8):
        watch.observe(step, **make_step(seed=step, noise=0.0))
    return watch


def _page(watch: rlwatch.Watch) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{watch.port}/", timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
        return resp.read().decode()


def _text(page: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_the_page_shows_latest_values_a_held_alert_and_refreshes_itself():
    with _held_watch() as watch:
        assert {e.name for e in watch.evaluator.firing()} >= {"RLWatchKLSpike"}
        snap = watch.state.snapshot()
        page = _page(watch)
        text = _text(page)
    assert '<meta http-equiv="refresh" content="5">' in page and "refreshes every 5 s" in text
    assert "step 7" in text
    lag = snap.gauges["version_lag_max"][()]
    reward = snap.gauges["reward_mean"][()]
    assert f"max version lag (updates) {lag:.0f}" in text and f"reward mean {reward:.4g}" in text
    assert "KL(mu‖pi_old), k3 (nats) 0 " in text                         # the latest step's k3, not the peak
    spike = re.search(r"RLWatchKLSpike \(critical\): (.*?)\.", text).group(1)
    assert spike.strip() == "its condition no longer holds (k3 0 nats at step 7): holding until clear, 11 steps left"
    truncation = re.search(r"RLWatchISTruncationHigh \(warning\): (.*?) at step", text).group(1)
    assert truncation.startswith("firing, ") and truncation.endswith("% of tokens above the TIS cap")   # it holds


def test_the_page_without_steps_or_alerts():
    with rlwatch.Watch(run="quiet", port=0, store=None, alerts=False) as watch:
        text = _text(_page(watch))
    assert "no step observed yet" in text and "Headline signals None yet." in text
    assert "Not evaluated in this process" in text


def _chromium_args(profile: Path, *args: str) -> list[str]:
    return [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--hide-scrollbars", f"--user-data-dir={profile}", *args]


def _chromium(profile: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(_chromium_args(profile, *args), capture_output=True, text=True, timeout=timeout)


def test_the_page_in_a_real_browser(tmp_path):
    """Chromium renders the page (its DOM after load carries the values and the held alert), a
    screenshot shows it ($RLWATCH_SCREENSHOT_DIR keeps it for a person to look at), and a browser left
    open on it reloads it by itself and gets the newer step."""
    _browser()
    out = Path(os.environ.get("RLWATCH_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "landing-page.png"
    with _held_watch() as watch:
        url = f"http://127.0.0.1:{watch.port}/"
        dom = _chromium(tmp_path / "profile-dom", "--dump-dom", url)
        assert dom.returncode == 0, dom.stderr[-2000:]
        snapshot = _chromium(tmp_path / "profile-shot", "--window-size=1100,900", f"--screenshot={shot}", url)
        assert snapshot.returncode == 0, snapshot.stderr[-2000:]
        served: list[str] = []
        app = watch.exposition
        original = app._index_page

        def spy() -> bytes:                                    # the real server's answers, recorded
            body = original()
            served.append(body.decode())
            if len(served) == 1:
                watch.observe(8, **make_step(seed=8, noise=0.0))    # a newer step before the reload
            return body
        app._index_page = spy
        browser = subprocess.Popen(_chromium_args(tmp_path / "profile-live", "--remote-debugging-port=0", url),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 40
            while len(served) < 2 and time.monotonic() < deadline and browser.poll() is None:
                time.sleep(0.2)
        finally:
            os.killpg(browser.pid, signal.SIGTERM)
            browser.wait(timeout=30)
    text = _text(dom.stdout)
    assert "holding until clear, 11 steps left" in text and "Headline signals" in text
    assert "max version lag (updates)" in text
    assert len(served) >= 2, "the open page never reloaded itself"
    assert "step 7" in _text(served[0]) and "step 8" in _text(served[1])
    assert "holding until clear, 10 steps left" in _text(served[1])
    image = pytest.importorskip("PIL.Image").open(shot).convert("L")
    assert image.size == (1100, 900)
    dark = sum(image.histogram()[:128])                          # text drawn: not a blank or an error page
    assert dark > 2000, dark


def test_a_signal_at_zero_this_step_shows_the_window_its_firing_alert_reads():
    """Truncated episodes in every step, then a step with none: the row's 0.0% is the latest step's,
    and it says what the truncation alert, still firing, reads over its window."""
    with rlwatch.Watch(run="trunc", port=0, store=None, alerts=True) as watch:
        for step in range(9):
            fields = make_step(seed=step, noise=0.0)
            fields["truncated"] = torch.arange(16) < (8 if step < 8 else 0)
            watch.observe(step, **fields)
        assert "RLWatchTruncationRateHigh" in {e.name for e in watch.evaluator.firing()}
        window = watch.state.snapshot().gauges["alert_value"][("RLWatchTruncationRateHigh", "", "", "", "")]
        text = _text(_page(watch))
    row = re.search(r"truncated episodes (.*?\))", text).group(1)
    assert row == (f"0.0% at the latest step; {window:.1%} over the window of RLWatchTruncationRateHigh "
                   "(firing)"), row
    assert window > 0.3
