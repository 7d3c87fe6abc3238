"""The command line and process plumbing: ``rlwatch`` (:mod:`.cli`), zero-code instrumentation under
``rlwatch run`` (:mod:`.autoload`, :mod:`._bootstrap`), the child process it starts (:mod:`.child`) and the
installed distribution's identity (:mod:`.distribution`)."""
