"""How many of torch's intra-op threads rlwatch's own work uses, on the training thread and on
rlwatch's background worker (the trainer's setting is left as it was)."""

from __future__ import annotations

import contextlib
import threading
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
    """Give the calling (rlwatch) thread the engine's intra-op threads (one), leaving every other thread as it is.

    With OpenMP, each thread that enters a parallel region gets a team of its own: a background
    thread computing small steps would otherwise keep extra spinning threads competing with the
    trainer's. ``torch.set_num_threads`` sets the calling thread's OpenMP setting and a process-wide
    default that threads created later start from; a throw-away thread puts that default back."""
    import torch

    from ..signals.settings import CPU_THREADS

    default = torch.get_num_threads()
    if default == CPU_THREADS:
        return
    torch.set_num_threads(CPU_THREADS)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="rlwatch-threads")
    restore.start()
    restore.join()
