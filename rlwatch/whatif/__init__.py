"""``rlwatch whatif``: a discrete-event rollout-pipeline simulation (:mod:`.simulate`) fed with a run's
measured episode durations, training and sync seconds (:mod:`.measured`), compared across
synchronous, one-step-ahead and asynchronous designs with a recommendation (:mod:`.report`); the
reference chapter's duration model (:mod:`.model`) and its figures recomputed (:mod:`.chapter`)."""
