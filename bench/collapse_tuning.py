"""Choose the post-mortem's collapse rule (fraction of the running peak, evaluations it must hold)
on tuning curves, and report the chosen rule on separate test curves.

Tuning curves (seeds 0-199): a rise to a plateau with noise, then an abrupt or 1-3-step drop that
may climb back partly, or no drop at all (half of them), or a brief dip of 1-3 evaluations that
recovers (not a collapse), noise up to 35% of the level. Ties are broken towards the longer hold (fewer
false alarms on curves unlike these). Test curves (seeds 1000-1199, other shapes): slow declines over 10-25
steps, collapses in the last 3-6 evaluations, heavier noise, evaluations every 5 steps, full
recoveries after the drop, and dips of up to 3 evaluations. A curve's true onset is the first step
where its noise-free value is below half its noise-free peak. A rule scores a hit when it dates a
collapsing curve within 3 steps (one evaluation on sparse curves) of the true onset, a false alarm
when it dates one on a curve that does not collapse.

    python -m bench.collapse_tuning            # the grid on the tuning curves, the chosen rule on the test curves
    python -m bench.collapse_tuning --demo     # also the demo's scenarios (collapse, rescued, healthy; seeds 1-3)
"""

from __future__ import annotations

import argparse
import random

from rlwatch.postmortem.analysis import COLLAPSE_FRACTION, COLLAPSE_HOLD, COLLAPSE_TAIL, find_collapse

Curve = tuple[list[tuple[int, float]], int | None]      # (series, true onset or None)


def _clean(steps: int, peak: float, rise: int, drop_at: int | None, drop_len: int, low: float,
           recover_at: int | None, recover_to: float) -> list[float]:
    out = []
    for t in range(steps):
        v = peak * min(1.0, 0.3 + 0.7 * t / max(1, rise))
        if drop_at is not None and t >= drop_at:
            f = min(1.0, (t - drop_at + 1) / drop_len)
            v = v + (low - v) * f
            if recover_at is not None and t >= recover_at:
                v = low + (recover_to - low) * min(1.0, (t - recover_at + 1) / 8)
        out.append(v)
    return out


def _truth(clean: list[float]) -> int | None:
    best = float("-inf")
    for t, v in enumerate(clean):
        best = max(best, v)
        if v < 0.5 * best:
            return t
    return None


def _noisy(clean: list[float], noise: float, rng: random.Random, every: int = 1) -> list[tuple[int, float]]:
    return [(t, max(0.0, v + rng.gauss(0, noise * max(v, 0.05)))) for t, v in enumerate(clean) if t % every == 0
            or t == len(clean) - 1]


def tuning_curve(seed: int) -> Curve:
    rng = random.Random(seed)
    steps, peak, rise = 100, rng.uniform(0.3, 0.9), rng.randint(3, 20)
    kind = rng.choice(["collapse", "collapse", "none", "dip"])
    noise = rng.uniform(0.03, 0.35)
    if kind == "none":
        clean = _clean(steps, peak, rise, None, 1, 0, None, 0)
        return _noisy(clean, noise, rng), None
    if kind == "dip":                           # 1-2 evaluations down, then back: not a collapse
        clean = _clean(steps, peak, rise, None, 1, 0, None, 0)
        at, width = rng.randint(rise + 2, steps - 10), rng.randint(1, 3)
        for t in range(at, at + width):
            clean[t] *= rng.uniform(0.1, 0.4)
        return _noisy(clean, noise, rng), None
    drop_at = rng.randint(rise + 2, steps - 15)
    recover_at = drop_at + rng.randint(10, 40) if rng.random() < 0.5 else None
    clean = _clean(steps, peak, rise, drop_at, rng.randint(1, 3), peak * rng.uniform(0.0, 0.3), recover_at,
                   peak * rng.uniform(0.4, 0.8))
    return _noisy(clean, noise, rng), _truth(clean)


def test_curve(seed: int) -> tuple[Curve, str]:
    rng = random.Random(seed)
    steps, peak, rise = rng.choice([60, 100, 200]), rng.uniform(0.2, 0.9), rng.randint(3, 25)
    kind = rng.choice(["slow", "late", "noisy", "sparse", "full_recovery", "none", "dip3"])
    noise = 0.25 if kind == "noisy" else rng.uniform(0.03, 0.15)
    every = 5 if kind == "sparse" else 1
    if kind in ("none", "dip3"):
        clean = _clean(steps, peak, rise, None, 1, 0, None, 0)
        if kind == "dip3":
            at = rng.randint(rise + 2, steps - 10)
            for t in range(at, at + 3):
                clean[t] *= rng.uniform(0.1, 0.4)
        noise = min(noise, 0.1)
        return (_noisy(clean, noise, rng), None), kind
    drop_at = (steps - rng.randint(3, 6) if kind == "late" else rng.randint(rise + 2, steps - 30))
    drop_len = rng.randint(10, 25) if kind == "slow" else rng.randint(1, 3)
    recover_at = drop_at + drop_len + rng.randint(5, 15) if kind == "full_recovery" else None
    clean = _clean(steps, peak, rise, drop_at, drop_len, peak * rng.uniform(0.0, 0.3), recover_at, peak)
    return (_noisy(clean, noise, rng, every), _truth(clean)), kind


def score(curves: list[Curve], fraction: float, hold: int, tail: int, tolerance: int = 3) -> dict[str, float]:
    hits = misses = false_alarms = quiet = 0
    for series, truth in curves:
        found = find_collapse(series, fraction, hold, tail)
        if truth is None:
            false_alarms += found is not None
            quiet += found is None
        else:
            spacing = series[1][0] - series[0][0] if len(series) > 1 else 1
            ok = found is not None and abs(found.step - truth) <= max(tolerance, spacing)
            hits += ok
            misses += not ok
    collapsing, flat = hits + misses, false_alarms + quiet
    return {"hit_rate": hits / max(1, collapsing), "false_alarm_rate": false_alarms / max(1, flat),
            "collapsing": collapsing, "not_collapsing": flat}


def _demo(seeds: range) -> None:
    from dataclasses import replace

    from rlwatch.demo.scenario import SCENARIOS, run_scenario

    for scenario in ("collapse", "rescued", "healthy"):
        for seed in seeds:
            result = run_scenario(replace(SCENARIOS[scenario], seed=seed))
            found = find_collapse(result.heldout)
            print(f"demo {scenario:<8} seed {seed}: "
                  + (f"collapse at step {found.step}" + (f" ({found.recovery_text()})" if found.recovery else "")
                     if found else "no collapse"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", action="store_true", help="also date the demo scenarios' held-out reward")
    args = parser.parse_args()
    tuning = [tuning_curve(s) for s in range(200)]
    grid = [(f, h, t) for f in (0.4, 0.5, 0.6) for h in (1, 2, 3, 4, 5, 6, 8) for t in (1, 2, 3) if t <= h]
    rows = sorted(((score(tuning, *rule), rule) for rule in grid),
                  key=lambda r: (r[0]["false_alarm_rate"] - r[0]["hit_rate"], -r[1][1], -r[1][2]))
    print("tuning curves (seeds 0-199): the best rules, fraction / hold / tail")
    for s, (f, h, t) in rows[:8]:
        print(f"  {f:.1f} / {h} / {t}: hits {s['hit_rate']:.1%} of {s['collapsing']}, "
              f"false alarms {s['false_alarm_rate']:.1%} of {s['not_collapsing']}")
    chosen = (COLLAPSE_FRACTION, COLLAPSE_HOLD, COLLAPSE_TAIL)
    s = score(tuning, *chosen)
    print(f"shipped rule {chosen[0]} / {chosen[1]} / {chosen[2]} on the tuning curves: hits {s['hit_rate']:.1%}, "
          f"false alarms {s['false_alarm_rate']:.1%}")
    print("test curves (seeds 1000-1199, other shapes), shipped rule:")
    tests = [test_curve(s) for s in range(1000, 1200)]
    for kind in sorted({k for _, k in tests}):
        s = score([c for c, k in tests if k == kind], *chosen)
        rate = (f"false alarms {s['false_alarm_rate']:.1%} of {s['not_collapsing']}" if s["collapsing"] == 0
                else f"hits {s['hit_rate']:.1%} of {s['collapsing']}")
        print(f"  {kind:<14} {rate}")
    s = score([c for c, _ in tests], *chosen)
    print(f"  all            hits {s['hit_rate']:.1%} of {s['collapsing']}, false alarms "
          f"{s['false_alarm_rate']:.1%} of {s['not_collapsing']}")
    if args.demo:
        _demo(range(1, 4))


if __name__ == "__main__":
    main()
