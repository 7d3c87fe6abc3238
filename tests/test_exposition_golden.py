"""The exposition of a fixed sequence of steps, byte for byte, against the recorded files
(``tests/data/exposition_golden.txt``/``.om.txt``).

The steps go through the whole pipeline: validation (one bad field, counted), the signals, drift,
diagnosis, the alert evaluator, ``log_scalars`` and a per-run alert override. Only the values that
depend on the clock (compute time, timestamps, intervals) are masked. Regenerate (only when a metric
is meant to change): ``python -m tests.test_exposition_golden`` (``--check``: exit 1 when stale), or
``make generate`` with every other generator.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data"
#: Series whose value is a clock reading or a duration: their values are masked, names and labels kept.
CLOCK = re.compile(r"^(rlwatch_(?:(?:step_)?hook_compute_seconds|last_step_timestamp_seconds|step_interval_seconds)"
                   r"[^ ]*) \S+(.*)$", re.M)


def _steps():
    from tests.conftest import make_step

    for step in range(6):
        fields = make_step(B=16, T=24, seed=step, lag_max=step % 4, noise=0.05 * (step + 1))
        if step == 4:
            fields["rewards"] = torch.ones(3)          # wrong shape: counted, the rest of the step used
        yield step, fields


def render() -> tuple[str, str]:
    """(text format, OpenMetrics) after the fixed steps, clock values masked."""
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    import os

    import rlwatch

    previous = os.environ.get("RLWATCH_RUN_INSTANCE")
    os.environ["RLWATCH_RUN_INSTANCE"] = "golden-host-1"        # the label is per process; fixed here
    try:
        watch = rlwatch.Watch(run="golden", port=None, store=None, alerts=True, group_size=4,
                              alert_overrides={"kl_k3_max": 0.05}, framework="custom",
                              framework_version="1")
    finally:
        if previous is None:
            del os.environ["RLWATCH_RUN_INSTANCE"]
        else:
            os.environ["RLWATCH_RUN_INSTANCE"] = previous
    try:
        for step, fields in _steps():
            watch.observe(step, **fields)
            watch.log_scalars(step, {"loss": 0.5 / (step + 1), "grad norm": torch.tensor(1.0 + step)})
        text = generate_latest(watch.registry).decode()
        openmetrics = generate_openmetrics(watch.registry).decode()
    finally:
        watch.close()
    mask = lambda s: CLOCK.sub(r"\1 <clock>\2", s)  # noqa: E731
    return mask(text), mask(openmetrics)


def test_exposition_of_fixed_steps_is_unchanged_byte_for_byte():
    text, openmetrics = render()
    assert text == (DATA / "exposition_golden.txt").read_text()
    assert openmetrics == (DATA / "exposition_golden.om.txt").read_text()


if __name__ == "__main__":
    import sys

    text, openmetrics = render()
    files = {DATA / "exposition_golden.txt": text, DATA / "exposition_golden.om.txt": openmetrics}
    if "--check" in sys.argv[1:]:
        stale = [path.name for path, body in files.items() if not path.exists() or path.read_text() != body]
        if stale:
            print(f"{', '.join(stale)} stale: run `python -m tests.test_exposition_golden`", file=sys.stderr)
        sys.exit(1 if stale else 0)
    for path, body in files.items():
        path.write_text(body)
