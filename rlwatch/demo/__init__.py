"""Demo engine: a tiny real RL training that reproduces stale-policy, hacking and sampler faults."""

from .scenario import SCENARIOS, ScenarioConfig, ScenarioResult, StepInfo, collapse_step, run_scenario

__all__ = ["SCENARIOS", "ScenarioConfig", "ScenarioResult", "StepInfo", "collapse_step", "run_scenario"]


#: How the demo and the acceptance suite configure rlwatch for the scenario engine: the thresholds the
#: acceptance report tuned on the matrix's tuning split (evaluation.acceptance, alerts/acceptance.md).
#: The toy policy moves far more per update than a large model trained at a small learning rate (its
#: k3 between consecutive versions is ~0.1-1 nats where an LLM's is ~1e-3), so the KL bound is scaled
#: up: 1.7 is the geometric midpoint of the bounds that meet every bar on the tuning split (0.84-3.25);
#: the lag factor 1.5 pages at a maximum lag above 3 (the lag-4 collapses); the staleness bound is the
#: Agent RL tutorial's recommendation (eta in {1, 2}). The departure page and the drift warning need k3 above
#: kl_departure_floor = the KL bound: a toy policy's k3 climbs 10-100x its start while healthy (1.0-1.3).
WATCH_CONFIG = {"staleness_bound": 2,
                "alert_overrides": {"kl_k3_max": 1.7, "lag_critical_factor": 1.5, "kl_jump_floor": 1.0,
                                    "kl_departure_floor": 1.7}}
