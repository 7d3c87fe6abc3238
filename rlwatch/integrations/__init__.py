"""One hook into each trainer: ``rlwatch.integrations.trl``, ``.verl``, ``.openrlhf``.

Each package has the same shape (see ``_instrumentor``): ``SUPPORTED`` (a ``packaging`` specifier set), a
``PATCHES`` table of (owner, attribute, ``Hook``) rows whose hooks are methods of its instrumentor,
and ``instrument()`` / ``uninstrument()`` (TRL: ``watch(trainer)`` / ``unwatch(trainer)``). Each
builds a step's ``rlwatch.core.fields.StepFields`` and hands it to ``Watch.observe_fields``. Each registers
itself for ``rlwatch run`` with an ``AUTOLOAD`` (:mod:`.registry`).
"""
