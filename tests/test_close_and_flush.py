"""What ``close()`` and ``flush()`` promise (issue 37, items 11 and 12): close() waits at most 2 s for
one more scrape of an unseen alert incident, even when /metrics was fetched only once; flush() is
False when the store could not be opened or when a step was lost since the previous flush; the
intermittent window has an upper bound."""

from __future__ import annotations

import sqlite3
import threading
import time
import urllib.request

import pytest

from rlwatch import Watch

from tests.conftest import make_step


def _steps(watch: Watch, steps: range, r: float) -> None:
    for step in steps:
        watch.observe(step, mask=[[1] * 8] * 4, sampler_logp=[[-1.0] * 8] * 4, trainer_logp=[[-1.0 + r] * 8] * 4)


def test_close_after_one_fetch_of_metrics_waits_at_most_2s_for_an_unseen_incident():
    watch = Watch(run="once", port=0, store=None, alerts=False)
    _steps(watch, range(3), 0.01)
    urllib.request.urlopen(watch.url, timeout=5).read()            # a person, a health probe: once
    _steps(watch, range(3, 6), 1.5)                                # RLWatchKLSpike opens, unseen
    closer = threading.Thread(target=watch.close, daemon=True)
    start = time.monotonic()
    closer.start()
    closer.join(timeout=10)
    took = time.monotonic() - start
    assert not closer.is_alive() and took < 2.5, took


def test_flush_is_false_when_the_store_could_not_be_opened(tmp_path):
    (tmp_path / "a-file").write_text("")
    with Watch(run="nostore", port=None, store=str(tmp_path / "a-file" / "s.db"), alerts=False) as watch:
        watch.observe(0, **make_step(B=4, T=8))
        assert watch.errors.snapshot().get(("store", "open")) == 1
        assert watch.flush() is False                              # nothing would survive a kill
    with Watch(run="nostore", port=None, store=None, alerts=False) as watch:
        watch.observe(0, **make_step(B=4, T=8))
        assert watch.flush() is True                               # no store asked for: computed


def test_flush_is_false_when_a_step_was_lost_since_the_previous_flush(tmp_path):
    path = str(tmp_path / "s.db")
    with Watch(run="lossy", port=None, store=path, alerts=False) as watch:
        assert watch.flush()
        with sqlite3.connect(path) as conn:                        # the database refuses step 3
            conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON steps WHEN NEW.step = 3 "
                         "BEGIN SELECT RAISE(ABORT, 'refused'); END")
        step = make_step(B=4, T=8)
        for i in range(6):
            watch.observe(i, **step)
        assert watch.flush() is False and watch.store.dropped == 1
        for i in range(6, 9):
            watch.observe(i, **step)
        assert watch.flush() is True                               # steps 6-8 are all stored


@pytest.mark.parametrize("value", [1e18, 1001, 0.5])
def test_intermittent_steps_has_a_documented_range(value):
    with pytest.raises(ValueError, match=r"intermittent_steps must be a number in \[1, 1000\]"):
        Watch(run="window", port=None, store=None, alert_overrides={"intermittent_steps": value})
    with Watch(run="window", port=None, store=None, alert_overrides={"intermittent_steps": 1000}) as watch:
        assert watch.active
