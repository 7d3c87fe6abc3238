"""``rlwatch replay``: the alert evaluator and the post-mortem over a run's logged metrics (TRL's
``trainer_state.json``, verl's console or JSONL log, OpenRLHF's log, ms-swift's ``logging.jsonl``, a W&B,
TensorBoard or SwanLab CSV), no trainer needed. docs/replay.md."""

from .formats import FORMATS, ReplayInputError
from .logged import LoggedRun, load, load_all, reward_keys
from .run import AlertEntry, ReplayResult, replay

__all__ = ["FORMATS", "AlertEntry", "LoggedRun", "ReplayInputError", "ReplayResult", "load", "load_all", "replay",
           "reward_keys"]
