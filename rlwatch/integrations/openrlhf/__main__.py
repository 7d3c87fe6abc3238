"""``python -m rlwatch.integrations.openrlhf <OpenRLHF arguments>``: see :func:`launch`."""

from . import launch

launch()
