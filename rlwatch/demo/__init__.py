"""Demo engine: a tiny real RL training that reproduces stale-policy, hacking and sampler faults."""

from .scenario import SCENARIOS, ScenarioConfig, ScenarioResult, StepInfo, collapse_step, run_scenario

__all__ = ["SCENARIOS", "ScenarioConfig", "ScenarioResult", "StepInfo", "collapse_step", "run_scenario"]


#: How the demo and the acceptance suite configure rlwatch for the scenario engine. The toy policy
#: moves far more per update than a large model trained at a small learning rate (its k3 between
#: consecutive versions is ~0.1-1 nats where an LLM's is ~1e-3), so the KL bound is scaled up to
#: match: 1.0 is the most sensitive of 0.1/0.2/0.5/1/2 with no critical page on a healthy run of the
#: matrix's tuning split (rlwatch.demo.acceptance, alerts/acceptance.md); the staleness bound is the
#: reference text's recommendation (eta in {1, 2}).
WATCH_CONFIG = {"staleness_bound": 2, "alert_overrides": {"kl_k3_max": 1.0, "kl_jump_floor": 1.0}}
