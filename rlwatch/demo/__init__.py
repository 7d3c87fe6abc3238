"""Demo engine: a tiny real RL training that reproduces stale-policy, hacking and sampler faults."""

from .scenario import SCENARIOS, ScenarioConfig, ScenarioResult, StepInfo, collapse_step, run_scenario

__all__ = ["SCENARIOS", "ScenarioConfig", "ScenarioResult", "StepInfo", "collapse_step", "run_scenario"]
