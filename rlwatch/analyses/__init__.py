"""Analyses of the step values that run inside the hook, after the signals: baseline-relative drift
(:mod:`.drift`) and the named cause of a mismatch (:mod:`.diagnosis`, thresholds in :mod:`.diagnosis_tuned`)."""
