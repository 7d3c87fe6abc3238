"""What a trainer calls: :class:`~.watch.Watch` and :func:`~.compute.compute`, and the step's path behind
them: :mod:`.pipeline` runs build -> compute -> derive -> evaluate -> sinks, :mod:`.lifecycle` starts and
stops what lives as long as a Watch (endpoint, store, push, OpenTelemetry, alert evaluator, worker)."""
