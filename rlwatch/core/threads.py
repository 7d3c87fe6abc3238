"""How many of torch's intra-op threads rlwatch's own work uses, on the training thread and on
rlwatch's background worker (the trainer's setting is left as it was)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

SMALL_BATCH = 1 << 18      # [B, T] positions below which CPU signals run on one intra-op thread


@contextlib.contextmanager
def few_threads_for(mask: Any) -> Iterator[None]:
    """Run a small CPU step's signals on one intra-op thread, then restore the trainer's setting.

    A small step's signals are a few hundred tiny reductions; with several intra-op threads each one
    waits for the others to wake, which on a busy host costs milliseconds per reduction. Large
    batches keep every thread, and GPU tensors are unaffected. Only rlwatch's own work runs in
    between, on the training thread, so the trainer's numbers do not change."""
    from ..signals.fused import one_intra_op_thread

    with one_intra_op_thread(mask.device.type == "cpu" and mask.numel() < SMALL_BATCH):
        yield


def one_intra_op_thread_here() -> None:
    """Give the calling (rlwatch) thread one intra-op thread, leaving every other thread as it is.

    With OpenMP, each thread that enters a parallel region gets a team of its own: a background
    thread computing small steps would otherwise keep extra spinning threads competing with the
    trainer's. ``torch.set_num_threads`` sets the calling thread's OpenMP setting and a process-wide
    default that threads created later start from; a throw-away thread puts that default back."""
    import torch

    default = torch.get_num_threads()
    if default == 1:
        return
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="rlwatch-threads")
    restore.start()
    restore.join()
