"""``python -m rlwatch``: the ``rlwatch`` command."""

from .ops.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
