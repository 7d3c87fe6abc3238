"""Watch with ``background=True`` and the training thread: the same steps exported in order, errors
counted, a stuck or slow rlwatch thread, guard or alert callback never holding ``observe`` for long, the
queue bounded by bytes, and ``close()`` while other threads observe."""

from __future__ import annotations

import threading
import time

import torch

import rlwatch
from rlwatch.runs.store import StoreReader

from .conftest import make_step
from ._watch_helpers import sample, scrape


def test_background_mode_exports_the_same_steps_in_order(tmp_path):
    """Watch(background=True): observe() returns at once, and after flush() the endpoint and the store
    hold exactly what the same steps give when computed on the calling thread."""
    steps = [make_step(B=8, T=16, seed=s) for s in range(12)]
    results = {}

    def in_a_new_thread() -> int:
        seen: list[int] = []
        spawned = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        spawned.start()
        spawned.join()
        return seen[0]

    for mode in ("inline", "background"):
        store = str(tmp_path / f"{mode}.db")
        # This thread's setting and the one threads started later get, before the Watch: neither changes.
        threads, threads_later = torch.get_num_threads(), in_a_new_thread()
        with rlwatch.Watch(run=mode, port=0, store=store, background=mode == "background") as watch:
            returned = [watch.observe(i, **step) for i, step in enumerate(steps)]
            watch.log_scalars(11, {"loss": 0.5})
            assert watch.flush()
            samples = scrape(watch.url)
            assert torch.get_num_threads() == threads
            assert in_a_new_thread() == threads_later
        with StoreReader(store) as reader:
            rows = reader.steps(mode)
        results[mode] = (returned, samples, rows)
    returned, samples, rows = results["background"]
    assert returned == [None] * 12
    assert [r.step for r in rows] == list(range(12))
    for a, b in zip(results["inline"][2], rows, strict=True):
        assert {k: v for k, v in a.values.items() if "seconds" not in k} == \
               {k: v for k, v in b.values.items() if "seconds" not in k}
    assert sample(samples, "rlwatch_steps_total", run="background") == 12
    assert sample(samples, "rlwatch_mismatch_kl_k3", run="background") == \
        sample(results["inline"][1], "rlwatch_mismatch_kl_k3", run="inline")
    assert samples[("rlwatch_framework_metric", (("name", "loss"), ("run", "background")))] == 0.5


def test_background_errors_are_counted_and_close_computes_what_is_queued(tmp_path):
    watch = rlwatch.Watch(run="bg", port=None, store=str(tmp_path / "bg.db"), background=True)
    watch.observe(0, mask=torch.ones(2, 3), trainer_logp=torch.zeros(5))            # bad shape
    watch.defer(lambda: 1 / 0)
    for i in range(1, 30):
        watch.observe(i, **make_step(seed=i))
    watch.close()                                                                   # no flush first
    assert watch.errors.counts[("validate", "shape")] == 1
    assert watch.errors.counts[("background", "ZeroDivisionError")] == 1
    with StoreReader(str(tmp_path / "bg.db")) as reader:
        rows = reader.steps("bg")
    assert [r.step for r in rows] == list(range(30))          # step 0 without its bad field
    assert rows[0].get("mismatch_kl_k3") is None and rows[1].get("mismatch_kl_k3") is not None


def test_a_stuck_background_thread_never_blocks_the_trainer_for_long():
    """A job that never ends (say a user's guard hanging on a network file system) fills the queue;
    observe() then waits at most the worker's max_wait before dropping the step, counted."""
    import time

    release = threading.Event()
    watch = rlwatch.Watch(run="stuck", port=None, store=None, background=True)
    watch._worker.max_wait = 0.2
    watch.defer(release.wait)
    step = make_step(B=2, T=4)
    start = time.perf_counter()
    for i in range(70):                                  # the queue holds 64
        watch.observe(i, **step)
    assert time.perf_counter() - start < 5
    assert watch.errors.counts[("background", "TimeoutError")] >= 1
    release.set()
    watch.close()


def test_background_queue_is_bounded_by_bytes():
    """Steps of 4 MiB of tensors each, observed faster than a slow rlwatch thread computes them:
    the queue never holds more than background_max_bytes (plus one step), and every step's tensors
    are freed once it ran (checked with weak references, as memory on an accelerator would be)."""
    import weakref

    slow = threading.Event()

    class Slow:
        def on_step(self, step, values):
            slow.wait(0.05)

        def close(self):
            pass

    step_bytes = 4 << 20
    watch = rlwatch.Watch(run="bytes", port=None, store=None, alerts=False, background=True,
                          background_max_bytes=4 * step_bytes, listeners=(Slow(),))
    alive: list = []
    most = 0
    try:
        for i in range(20):
            step = make_step(B=2, T=8, seed=i)
            step["entropy"] = torch.rand(2, 8)
            step["filler"] = torch.zeros(step_bytes // 4)           # an unknown field: held, never used
            alive.append(weakref.ref(step["filler"]))
            watch.observe(i, **step)
            del step
            most = max(most, sum(ref() is not None for ref in alive))
        assert watch.flush(30)
    finally:
        watch.close()
    assert most <= 5, most                         # 4 queued + the one being submitted
    assert watch._worker.peak_bytes <= 4 * step_bytes + step_bytes
    assert sum(ref() is not None for ref in alive) == 0


def test_close_while_other_threads_observe_is_prompt_and_counts_what_it_refused():
    """Threads keep observing while the background Watch closes: close() returns in seconds, every
    step is either computed or counted as refused after close."""
    import time

    watch = rlwatch.Watch(run="closing", port=None, store=None, alerts=False, background=True)
    step = make_step(B=4, T=8)
    stop = threading.Event()
    submitted = [0, 0, 0]

    def observe_forever(k):
        i = 0
        while not stop.is_set():
            watch.observe(k * 1_000_000 + i, **step)
            submitted[k] += 1
            i += 1

    threads = [threading.Thread(target=observe_forever, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.perf_counter()
    watch.close()
    closing = time.perf_counter() - start
    stop.set()
    for t in threads:
        t.join()
    assert closing < 5, closing
    computed = int(watch.state.snapshot().counters["steps_total"][()])
    refused = watch.errors.counts[("observe", "after_close")]
    assert computed + refused == sum(submitted), (computed, refused, submitted)
    assert refused > 0


def _spiking_watch(run: str, **options) -> rlwatch.Watch:
    """A Watch whose KLSpike (critical) fires at step 1 of make_step(noise=0.5) steps."""
    return rlwatch.Watch(run=run, port=None, store=None, alerts=True, alert_overrides={"kl_k3_max": 0.01}, **options)


def test_an_alert_callback_may_call_the_watch_and_its_evaluator():
    """An on_alert callback that reads what is firing and notes it on the Watch (on main: a deadlock,
    the evaluator held its non-reentrant lock while it ran the callback)."""
    watch = _spiking_watch("callback")
    seen = []

    def callback(event):
        seen.append((event.name, event.state, sorted(e.name for e in watch.evaluator.firing())))
        watch.note("alert_seen", event.name)

    watch.on_alert(callback)

    def train():
        for step in range(3):
            watch.observe(step, **make_step(seed=step, noise=0.5))
        watch.close()

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    trainer.join(timeout=60)
    assert not trainer.is_alive(), "the training thread is stuck in an on_alert callback"
    assert ("RLWatchKLSpike", "firing", ["RLWatchKLSpike"]) in seen, seen
    assert watch.errors.total() == 0


def test_a_slow_guard_never_holds_observe_and_a_failing_one_is_counted():
    """A 10 s guard runs on rlwatch's alert-actions thread: the step that fired returns at once (on
    main it took the guard's 10 s); a guard that raises is counted, and the others still run."""
    release, ran = threading.Event(), []

    def slow(event):
        ran.append(event.name)
        release.wait(10)

    def failing(event):
        raise RuntimeError("guard bug")

    watch = _spiking_watch("guards", guard=(failing, slow))
    durations = []
    try:
        for step in range(3):
            start = time.perf_counter()
            watch.observe(step, **make_step(seed=step, noise=0.5))
            durations.append(time.perf_counter() - start)
        assert max(durations) < 2.0, durations          # the guard would hold it 10 s
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["RLWatchKLSpike"]
    finally:
        release.set()
    watch.close()
    assert watch.errors.counts[("alerts", "guard")] == 1
