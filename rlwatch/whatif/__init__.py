"""``rlwatch whatif``: a discrete-event rollout-pipeline simulation (:mod:`.simulate`) fed with a run's
measured episode durations, training and sync seconds (:mod:`.measured`), compared across
synchronous, one-step-ahead and asynchronous designs with a recommendation (:mod:`.report`); the
duration model of chapter 13 of the Agent RL tutorial (:mod:`.model`) and its figures recomputed (:mod:`.chapter`)."""
