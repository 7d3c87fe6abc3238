"""The acceptance bars: what one replayed run produced (:class:`Outcome`, its alert :class:`Event` s),
the figures of a set of runs (:func:`score`) and the bars they must meet (:func:`bars`). Shared by
:mod:`evaluation.acceptance` (replay, tuning) and :mod:`evaluation.acceptance_report` (Markdown)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .matrix import RunSpec

TUNED_PARAMS = ("kl_k3_max", "lag_critical_factor", "intermittent_hits", "intermittent_steps", "ess_min")
STALENESS_BOUND = 2
FLAP_STEPS = 10
SEMANTIC_STEPS = 10
#: An intermittent fault must page within this many steps of its first faulty step.
INTERMITTENT_STEPS = 10
HACK_HOLD = 0.2
#: The sampler-learner mismatch warnings whose rate on healthy runs is a bar.
MISMATCH_WARNINGS = ("RLWatchMismatchDrift", "RLWatchKLJump")


@dataclass
class Event:
    name: str
    severity: str
    state: str
    step: int
    labels: dict
    value: float | None


@dataclass
class Outcome:
    run: str
    family: str
    scenario: str
    kind: str
    seed: int
    steps: int
    collapse_step: int | None
    events: list[Event] = field(default_factory=list)
    firing_at_end: list[str] = field(default_factory=list)
    error: str | None = None
    hack_took_hold: bool = False

    def firings(self, severity: str | None = None) -> list[Event]:
        return [e for e in self.events if e.state == "firing" and (severity is None or e.severity == severity)]

    @property
    def first_critical(self) -> Event | None:
        critical = self.firings("critical")
        return min(critical, key=lambda e: e.step) if critical else None

    @property
    def lead(self) -> int | None:
        first = self.first_critical
        if self.collapse_step is None or first is None or first.step >= self.collapse_step:
            return None
        return self.collapse_step - first.step

    @property
    def flaps(self) -> int:
        """Firings of an alert (same labels) within FLAP_STEPS steps of its previous resolution."""
        return len(refirings(self))


def score(outcomes: list[Outcome]) -> dict[str, object]:
    ok = [o for o in outcomes if o.error is None]
    healthy = [o for o in ok if o.kind == "healthy"]
    collapsing = [o for o in ok if o.kind == "collapse" and o.collapse_step is not None and o.collapse_step > 0]
    semantic = [o for o in ok if o.kind == "semantic"]
    hack = [o for o in ok if o.kind == "hack"]
    infra = [o for o in ok if o.kind == "infra"]
    intermittent = [o for o in ok if o.kind == "intermittent"]
    lag_fault = [o for o in ok if o.kind == "lag_fault"]
    leads = [o.lead for o in collapsing if o.lead is not None]
    mismatch_warnings = sum(1 for o in healthy for e in o.firings("warning") if e.name in MISMATCH_WARNINGS)
    fractions = [o.lead / o.collapse_step for o in collapsing if o.lead is not None]

    def intermittent_ok(o: Outcome) -> bool:
        from rlwatch.demo.config import ScenarioConfig

        first = o.first_critical
        return first is not None and 0 <= first.step - ScenarioConfig.intermittent_from < INTERMITTENT_STEPS

    def semantic_ok(o: Outcome) -> bool:
        first = min((e.step for e in o.firings("critical") if e.name == "RLWatchOnPolicyRatioNotOne"), default=None)
        return first is not None and first <= SEMANTIC_STEPS and "RLWatchOnPolicyRatioNotOne" in o.firing_at_end

    def hack_envs(o: Outcome) -> set[str]:
        return {e.labels.get("env", "") for e in o.firings() if e.name == "RLWatchRewardHackRateRising"}

    buggy = {o.run: RunSpec(o.family, o.scenario, o.seed).buggy_env for o in hack}      # any seed
    took_hold = [o for o in hack if o.hack_took_hold]
    return {
        "runs": len(outcomes), "runs_failed": len(outcomes) - len(ok),
        "healthy_runs": len(healthy),
        "healthy_critical_pages": sum(len(o.firings("critical")) for o in healthy),
        "healthy_runs_paged": sum(bool(o.firings("critical")) for o in healthy),
        "healthy_warnings": sum(len(o.firings("warning")) for o in healthy),
        "healthy_mismatch_warnings": mismatch_warnings,
        "mismatch_warnings_per_healthy_run": round(mismatch_warnings / max(1, len(healthy)), 3),
        "collapse_runs": sum(o.kind == "collapse" for o in ok),
        "collapsed": len(collapsing),
        "collapsed_paged_before": sum(o.lead is not None for o in collapsing),
        "lead_min": min(leads) if leads else None,
        "lead_median": statistics.median(leads) if leads else None,
        "lead_fraction_median": round(statistics.median(fractions), 3) if fractions else None,
        "semantic_runs": len(semantic), "semantic_ok": sum(semantic_ok(o) for o in semantic),
        "intermittent_runs": len(intermittent), "intermittent_ok": sum(intermittent_ok(o) for o in intermittent),
        "hack_runs": len(hack), "hack_took_hold": len(took_hold),
        "hack_buggy_env_only": sum(hack_envs(o) == {buggy[o.run]} for o in took_hold),
        # A false hack alert names an environment whose grader is sound: any on a run without the bug,
        # another environment on a hack run. On the buggy environment it is not false even when the
        # exploit stayed below HACK_HOLD: episodes were hacked, at the rate the alert claims.
        "hack_alert_on_a_sound_grader": sum(bool(hack_envs(o) - ({buggy[o.run]} if o.kind == "hack" else set()))
                                            for o in ok),
        "hack_alert_below_hold": sum(bool(hack_envs(o)) for o in hack if not o.hack_took_hold),
        "infra_runs": len(infra),
        "infra_warned": sum(any(e.name == "RLWatchInfraFailureRateHigh" for e in o.firings()) for o in infra),
        "lag_fault_runs": len(lag_fault), "lag_fault_paged": sum(bool(o.firings("critical")) for o in lag_fault),
        "flaps": sum(o.flaps for o in ok),
        "critical_flaps": sum(1 for o in ok for e in refirings(o) if e.severity == "critical"),
    }


def refirings(o: Outcome) -> list[Event]:
    """The firings of an alert (same labels) within FLAP_STEPS steps of its previous resolution."""
    resolved: dict[tuple, int] = {}
    out = []
    for e in o.events:
        key = (e.name, tuple(sorted(e.labels.items())))
        if e.state == "resolved":
            resolved[key] = e.step
        elif key in resolved and e.step - resolved[key] <= FLAP_STEPS:
            out.append(e)
    return out


def bars(s: dict) -> dict[str, bool]:
    return {
        "0 critical pages on healthy runs": s["healthy_critical_pages"] == 0,
        "every collapse paged before it": s["collapsed_paged_before"] == s["collapsed"],
        "median lead >= half the steps to the collapse": (s["collapsed"] == 0
                                                          or (s["lead_fraction_median"] or 0) >= 0.5),
        "0 flaps": s["flaps"] == 0,
        "mismatch warnings (drift, jump) <= 0.5 per healthy run": s["mismatch_warnings_per_healthy_run"] <= 0.5,
        "semantic faults critical within 10 steps and firing at the end": s["semantic_ok"] == s["semantic_runs"],
        "intermittent faults critical within 10 steps of the first faulty step": (s["intermittent_ok"]
                                                                                  == s["intermittent_runs"]),
        "hack alert on the hacked environment only": (s["hack_buggy_env_only"] == s["hack_took_hold"]
                                                      and s["hack_alert_on_a_sound_grader"] == 0),
    }
