"""``rlwatch.compute``: every signal of one step from plain tensors, without a Watch."""

from __future__ import annotations

from ..signals import SignalConfig, Workspace, compute_step
from ..core.config import compile_variable
from ..core.errors import HookErrors
from ..core.record import RecordBuilder
from ..core.values import StepValues


def compute(config: SignalConfig | None = None, **fields) -> StepValues:
    """Compute every signal of one step from plain tensors, without exporting anything.

    Takes the same fields as :meth:`rlwatch.Watch.observe` (``mask`` required, ``step`` optional)
    and returns the same :class:`~rlwatch.StepValues` (``values.value("mismatch_kl_k3")``); raises
    :class:`~rlwatch.InvalidFieldError` on a malformed field.
    """
    config = config or SignalConfig()
    step = fields.pop("step", 0)
    builder = RecordBuilder(HookErrors(strict=True))
    ws = Workspace(compile=compile_variable())
    record = builder.build(step, fields, ws)
    assert record is not None
    return StepValues(compute_step(record, config, ws))
