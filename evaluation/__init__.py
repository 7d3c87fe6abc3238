"""The evaluation harness (not shipped in the wheel): the acceptance matrix of demo runs, the real-scale
family, the diagnosis and length-bias evaluations that chose the shipped thresholds on a tuning split and
report them on a test split. Run from the repository root, e.g. ``python -m evaluation.acceptance``."""
