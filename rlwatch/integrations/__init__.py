"""One hook into each trainer: ``rlwatch.integrations.trl``, ``.verl``, ``.openrlhf``.

Each module follows the same shape (see ``_base.Instrumentor``): the supported version range,
the functions it wraps, ``instrument()`` / ``uninstrument()``.
"""
