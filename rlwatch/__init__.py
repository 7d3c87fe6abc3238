"""rlwatch: per-token health signals for RL post-training of language models.

Quick start::

    import rlwatch
    with rlwatch.Watch(run="my-run") as watch:
        for step, batch in enumerate(loader):
            ...
            watch.observe(step, mask=mask, sampler_logp=mu_logp, trainer_logp=old_logp,
                          token_version=versions, trainer_version=step, rewards=rewards, group_ids=uids)
"""

__version__ = "0.1.0"

from .errors import InvalidFieldError, PortInUseError, RLWatchError  # noqa: E402
from .signals import SignalConfig, compute  # noqa: E402
from .watch import Watch  # noqa: E402

__all__ = ["Watch", "SignalConfig", "compute", "InvalidFieldError", "PortInUseError", "RLWatchError",
           "__version__"]
