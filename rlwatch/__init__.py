"""rlwatch: per-token health signals for RL post-training of language models."""

from .errors import InvalidFieldError, PortInUseError, RLWatchError
from .signals import SignalConfig, compute

__version__ = "0.1.0"

__all__ = ["SignalConfig", "compute", "InvalidFieldError", "PortInUseError", "RLWatchError", "__version__"]
