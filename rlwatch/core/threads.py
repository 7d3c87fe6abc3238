"""How many of torch's intra-op threads rlwatch's own work uses, on the training thread and on
rlwatch's background worker (the trainer's setting is left as it was)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def few_threads_for(mask: Any) -> Iterator[None]:
    """Run a CPU step's signals on the engine's intra-op threads (``signals.settings.CPU_THREADS``, one,
    whatever the step's size: the figures are there), then restore the trainer's setting. GPU tensors
    are unaffected. Only rlwatch's own work runs in between, on the training thread, so the trainer's
    numbers do not change."""
    from ..signals.settings import engine_plan, intra_op_threads

    with intra_op_threads(engine_plan(mask.device).threads):
        yield


def one_intra_op_thread_here() -> None:
    """Give the calling (rlwatch) thread the engine's intra-op threads (one), leaving every other thread as it is:
    a background thread computing small steps would otherwise keep extra spinning OpenMP threads competing
    with the trainer's."""
    from ..signals.settings import CPU_THREADS, set_this_threads_intra_op_threads

    set_this_threads_intra_op_threads(CPU_THREADS)
