"""The episode block (:func:`rlwatch.signals.episodes.episode_core`): few operations per step (the
tiny-step cost is its operation count), every value equal to a plain-Python reference over
episodes, on many random group/environment layouts, and group rows declared in a test computed."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlwatch.signals import episodes, quantities
from rlwatch.signals.pending import _finite

#: Eager operations of episode_core for a step with rewards, groups, truncation and 4 environments
#: (60 when written; 147 before the one-matrix rewrite).
MAX_OPS = 66
#: Rewards whose sums, squares and products are exact in float64, so that a reference summing in
#: another order gets the same bits (and a constant environment has a variance of exactly 0).
REWARDS = (-1.0, 0.0, 0.5, 1.0, 2.25)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _step(B: int, detectors: int = 0, seed: int = 0) -> tuple:
    """episode_core's inputs for B episodes: rewards 0/1, groups of 4, 4 environments, truncation."""
    g = torch.Generator().manual_seed(seed)
    hacked = torch.rand(detectors, B, generator=g) < 0.2 if detectors else None
    return (torch.randint(1, 64, (B,), generator=g).float(), torch.ones(B, dtype=torch.bool),
            torch.randint(0, 2, (B,), generator=g).double(), torch.arange(B) // 4, torch.arange(B) % 4,
            torch.zeros(4, dtype=torch.uint8), torch.rand(B, generator=g) < 0.3, hacked,
            torch.tensor(episodes.bound_values(None), dtype=torch.float64))


def _count(args: tuple) -> int:
    counter = _CountOps()
    with torch.inference_mode(), counter:
        episodes.episode_core(*args)
    return counter.ops


@pytest.mark.perf
def test_episode_core_op_count_is_small_and_independent_of_the_batch_size():
    _count(_step(8))                                     # the per-process constants made once, off the count
    ops = _count(_step(8))
    assert ops <= MAX_OPS, ops
    assert _count(_step(200)) == ops                     # no per-episode or per-group Python loop
    assert _count(_step(8, detectors=3)) <= MAX_OPS      # hack detectors: one more matrix block


def _layout(rnd: random.Random) -> dict:
    """A random step: groups of mixed sizes (some mixing environments), NaN/inf rewards, failed
    episodes, optional groups, environments, truncation and hack detectors."""
    B = rnd.choice([0, 1, 2, 3, 3, 4, 5, 7, 8, 12])
    step: dict = {"B": B, "lengths": [float(rnd.randint(0, 40)) for _ in range(B)],
                  "ok": [rnd.random() > rnd.choice([0.0, 0.3, 1.0]) for _ in range(B)]}
    step["rewards"] = None
    step["groups"] = None
    if rnd.random() < 0.85:
        constant = rnd.random() < 0.2
        value = rnd.choice(REWARDS)
        step["rewards"] = [value if constant else rnd.choice(REWARDS) for _ in range(B)]
        for i in range(B):
            if rnd.random() < 0.1:
                step["rewards"][i] = rnd.choice([math.nan, math.inf, -math.inf])
        if rnd.random() < 0.8:
            ids = rnd.choice([[7], [-3, 5], [0, 1, 2, 3], [2**40, -(2**40), 9], list(range(B + 1))])
            step["groups"] = [rnd.choice(ids) for _ in range(B)]
    step["E"] = rnd.choice([0, 0, 1, 2, 3])
    step["env"] = [rnd.randrange(step["E"]) for _ in range(B)] if step["E"] else None
    step["truncated"] = [rnd.random() < 0.3 for _ in range(B)] if rnd.random() < 0.7 else None
    D = rnd.choice([0, 1, 2]) if step["E"] else 0
    step["hacked"] = [[rnd.random() < 0.3 for _ in range(B)] for _ in range(D)]
    step["bounds"] = rnd.choice([None, None, (0.0, 1.0), (1.0, 0.0), (-1.0, 0.5)])
    return step


def _computed(step: dict) -> dict:
    """episode_core then finish_episodes on ``step``, as the engine calls them."""
    B, E = step["B"], step["E"]
    detectors = [f"d{k}" for k in range(len(step["hacked"]))]
    args = (torch.tensor(step["lengths"], dtype=torch.float32).reshape(B),
            torch.tensor(step["ok"], dtype=torch.bool).reshape(B),
            None if step["rewards"] is None else torch.tensor(step["rewards"], dtype=torch.float64).reshape(B),
            None if step["groups"] is None else torch.tensor(step["groups"], dtype=torch.int64).reshape(B),
            None if not E else torch.tensor(step["env"], dtype=torch.int64).reshape(B),
            None if not E else torch.zeros(max(E, 2), dtype=torch.uint8),
            None if step["truncated"] is None else torch.tensor(step["truncated"], dtype=torch.bool).reshape(B),
            torch.tensor(step["hacked"], dtype=torch.bool).reshape(len(detectors), B) if detectors else None,
            torch.tensor(episodes.bound_values(step["bounds"]), dtype=torch.float64))
    with torch.inference_mode():
        vector = episodes.episode_core(*args).tolist()
    rewards, groups = step["rewards"] is not None, step["groups"] is not None
    pos = quantities.episode_layout(rewards, groups, max(E, 2) if E else 0, step["truncated"] is not None, detectors)
    assert len(vector) == pos.size
    values = quantities.finish_episodes(vector, pos, [f"e{e}" for e in range(E)], detectors, step["bounds"])
    return {name: {k: _finite(x) for k, x in family.items()} for name, family in values.items()}   # as Pending


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _reference(step: dict) -> dict:
    """The episode signals written out over episodes and groups, one by one."""
    B, ok, lengths = step["B"], step["ok"], step["lengths"]
    out: dict = {}
    if B:
        ordered = sorted(lengths)
        for quantile in quantities.LENGTH_QUANTILES:
            rank = quantile * (B - 1)
            lo = math.floor(rank)
            hi = min(lo + 1, B - 1)
            out[f"response_length_p{round(100 * quantile)}"] = ordered[lo] + (rank - lo) * (ordered[hi] - ordered[lo])
        out.update(response_length_mean=sum(lengths) / B, response_length_max=max(lengths))
    else:
        out.update(response_length_mean=None, response_length_max=None, response_length_p95=None,
                   response_length_p99=None)
    if step["truncated"] is not None:
        out["truncated_ratio"] = _ratio(sum(step["truncated"]), B)
    usable = [False] * B
    constant_group: dict[int, bool] = {}
    if step["rewards"] is not None:
        rewards = step["rewards"]
        usable = [ok[i] and math.isfinite(rewards[i]) for i in range(B)]
        values = [rewards[i] for i in range(B) if usable[i]]
        out["nonfinite_rewards"] = float(sum(ok[i] and not usable[i] for i in range(B)))
        out["reward_mean"] = sum(values) / len(values) if values else None
        if values:
            mean = sum(values) / len(values)
            out["reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
        else:
            out["reward_std"] = None
        if step["groups"] is not None:
            out.update(_reference_groups(step, usable, values, constant_group))
    if step["E"]:
        out.update(_reference_envs(step, usable, constant_group))
    return out


def _reference_groups(step: dict, usable: list[bool], values: list[float], constant_group: dict) -> dict:
    rewards, ids = step["rewards"], step["groups"]
    members: dict[int, list[float]] = {}
    for i, gid in enumerate(ids):
        members.setdefault(gid, [])
        if usable[i]:
            members[gid].append(rewards[i])
    if step["bounds"] is not None:
        low, high = step["bounds"]
    else:
        low, high = (min(values), max(values)) if values else (math.inf, -math.inf)
    kinds = {"all_pass": 0, "all_fail": 0, "constant": 0}
    zero_episodes = 0
    for gid, rs in members.items():
        constant_group[gid] = bool(rs) and len(set(rs)) == 1
        if not constant_group[gid]:
            continue
        zero_episodes += len(rs)
        ref = rs[0]
        passing = ref >= high if high > low else ref > 0
        failing = not passing and (ref <= low if high > low else ref <= 0)
        kinds["all_pass" if passing else "all_fail" if failing else "constant"] += 1
    sizes = [len(rs) for rs in members.values() if rs]
    n_groups = len(sizes)
    return {"groups": float(n_groups),
            "zero_variance_groups_total": {k: float(c) for k, c in kinds.items()},
            "zero_variance_groups_ratio": {k: _ratio(c, n_groups) for k, c in kinds.items()},
            "zero_gradient_episodes_ratio": _ratio(zero_episodes, sum(usable)),
            "_group_size_min": min(sizes) if sizes else None,
            "_group_size_max": float(max(sizes, default=0)) if step["B"] else None}


def _reference_envs(step: dict, usable: list[bool], constant_group: dict) -> dict:
    B, env, lengths = step["B"], step["env"], step["lengths"]
    out: dict = {"env_episodes": {}, "env_reward_mean": {}, "env_reward_length_corr": {},
                 "env_truncated_ratio": {}, "episodes_truncated_total": {}, "env_zero_variance_groups_ratio": {},
                 "episodes_hacked_total": {}}
    for e in range(step["E"]):
        name = f"e{e}"
        mine = [i for i in range(B) if env[i] == e]
        out["env_episodes"][name] = float(len(mine))
        if step["rewards"] is not None:
            pairs = [(step["rewards"][i], lengths[i]) for i in mine if usable[i]]
            out["env_reward_mean"][name] = sum(r for r, _ in pairs) / len(pairs) if pairs else None
            out["env_reward_length_corr"][name] = _pearson(pairs)
        if step["truncated"] is not None:
            count = sum(step["truncated"][i] for i in mine)
            out["env_truncated_ratio"][name] = _ratio(count, len(mine))
            out["episodes_truncated_total"][name] = float(count)
        if step["groups"] is not None:
            # A group counts once for each environment among its episodes (failed ones included).
            present = {step["groups"][i] for i in mine}
            out["env_zero_variance_groups_ratio"][name] = _ratio(sum(constant_group[g] for g in present), len(present))
        for k, flags in enumerate(step["hacked"]):
            out["episodes_hacked_total"][(name, f"d{k}")] = float(sum(flags[i] for i in mine))
    return {name: rows for name, rows in out.items() if rows}


def _pearson(pairs: list[tuple[float, float]]) -> float | None:
    """Pearson correlation of (reward, length); None under 4 episodes or without variance."""
    if len(pairs) < 4:
        return None
    mr = sum(r for r, _ in pairs) / len(pairs)
    mn = sum(n for _, n in pairs) / len(pairs)
    vr = sum((r - mr) ** 2 for r, _ in pairs)
    vn = sum((n - mn) ** 2 for _, n in pairs)
    if vr == 0 or vn == 0:
        return None
    return sum((r - mr) * (n - mn) for r, n in pairs) / math.sqrt(vr * vn)


def _close(x: float | None, y: float | None) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_episode_core_equals_a_plain_python_reference(seed):
    rnd = random.Random(seed)
    for case in range(120):
        step = _layout(rnd)
        got, want = _computed(step), _reference(step)
        for name, expected in want.items():
            rows = got[name]
            if isinstance(expected, dict):
                labels = {k if isinstance(k, tuple) else (k,): v for k, v in expected.items()}
                assert set(rows) == set(labels), (seed, case, name, step)
                for k, v in labels.items():
                    assert _close(rows[k], v), (seed, case, name, k, rows[k], v, step)
            else:
                assert _close(rows[()], expected), (seed, case, name, rows[()], expected, step)


def test_a_declared_group_row_is_computed_from_its_declaration(monkeypatch):
    """A term over the group slots, and threshold rows that reuse thresholds out of their order (the
    thresholds are then indexed): each group row's sum is the plain count."""
    monkeypatch.setattr(quantities, "GROUP_ROWS", quantities.GROUP_ROWS + (
        quantities.GroupRow("size_sq", lambda g: g["size"] * g["size"]),
        quantities.GroupRow("neg_at_pass", base="neg", at="pass"),
        quantities.GroupRow("at_neg_fail", base="ref", at="neg_fail")))
    # Groups {1, 1}, {0, 0.5}, {0.5}, {-1}; (fail, pass) = (0, 1).
    rewards, ids = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, -1.0], dtype=torch.float64), torch.tensor([0, 0, 1, 1, 2, 3])
    with torch.inference_mode():
        v = episodes.episode_core(torch.ones(6), torch.ones(6, dtype=torch.bool), rewards, ids, None, None, None, None,
                                  torch.tensor(episodes.bound_values((0.0, 1.0)))).tolist()
    pos = quantities.episode_layout(True, True, 0, False, [])
    sums = dict(zip(pos.rows, v[pos.sums]))
    assert {name: sums[name] for name in [row.name for row in quantities.GROUP_ROWS]} == {
        "groups": 4, "zero_var": 3, "zero_var_episodes": 4, "size": 6, "size_gap": 4 * 7 - 6,
        "range_pass": 1, "range_fail": 1, "bounds_pass": 1, "bounds_fail": 1, "sign_pass": 2,
        "size_sq": 10, "neg_at_pass": 1, "at_neg_fail": 2}
