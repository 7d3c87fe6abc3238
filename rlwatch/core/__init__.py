"""The step's data and the run's state, below everything that composes them: a step's inputs
(:mod:`.fields`, :mod:`.rollout`) and their validation (:mod:`.record`), the catalogue of every metric
(:mod:`.metrics`), the step's values by catalogue name (:mod:`.values`), what the exporters read
(:mod:`.state`), every option and ``RLWATCH_*`` variable (:mod:`.config`), rlwatch's own errors
(:mod:`.errors`), the background worker (:mod:`.queues`) and threads (:mod:`.threads`)."""
