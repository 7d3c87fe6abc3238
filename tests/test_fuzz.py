"""10,000+ malformed step records: nothing reaches the trainer, every fault is counted under its
kind and logged once, the valid part is still exported, and the exposition stays valid."""

from __future__ import annotations

import logging
import subprocess
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import rlwatch
from rlwatch import InvalidFieldError

from tests.conftest import make_step, need_binary


def base(B: int, T: int, seed: int) -> dict:
    return make_step(B=B, T=T, seed=seed, envs=("math", "code"), group=2)


# Each fault: (name, apply(record, draw) -> (record, expected (stage, kind), field, still exported signal)).
def nan_logps(rec, draw):
    where = draw(st.sampled_from(["sampler_logp", "trainer_logp"]))
    value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    rec[where] = rec[where].clone()
    rec[where][0, 0] = value
    rec["mask"] = rec["mask"].clone()
    rec["mask"][0, 0] = True
    return rec, ("validate", "nonfinite_logp"), "sampler_logp/trainer_logp", "mismatch_kl_k3"


def wrong_shape(rec, draw):
    field = draw(st.sampled_from(["sampler_logp", "trainer_logp", "entropy", "token_version"]))
    B, T = rec["mask"].shape
    rec[field] = torch.zeros(B + draw(st.integers(1, 3)), T)
    return rec, ("validate", "shape"), field, "tokens"


def wrong_length(rec, draw):
    field = draw(st.sampled_from(["rewards", "group_ids", "truncated", "env", "failed"]))
    B = rec["mask"].shape[0]
    n = B + draw(st.integers(1, 4))
    rec[field] = (["x"] * n if field in ("env", "failed") else torch.zeros(n))
    return rec, ("validate", "shape"), field, "mismatch_kl_k3"


def empty_batch(rec, draw):
    T = draw(st.integers(0, 4))
    B = 0 if T else draw(st.integers(1, 3))
    out = dict(mask=torch.zeros(B, T, dtype=torch.bool), sampler_logp=torch.zeros(B, T),
               trainer_logp=torch.zeros(B, T))
    return out, ("validate", "empty"), "mask", "tokens"


def all_masked(rec, draw):
    rec["mask"] = torch.zeros_like(rec["mask"])
    return rec, ("validate", "all_masked"), "mask", "reward_mean"


def mask_dtype(rec, draw):
    kind = draw(st.sampled_from(["strings", "complex", "nested"]))
    B, T = rec["mask"].shape
    rec["mask"] = {"strings": [["a"] * T] * B, "complex": torch.ones(B, T, dtype=torch.complex64),
                   "nested": [[1, [2]]] * B}[kind]
    return rec, ("validate", "dtype" if kind == "complex" else "type"), "mask", None


def other_dtype(rec, draw):
    field = draw(st.sampled_from(["sampler_logp", "trainer_logp"]))
    rec[field] = rec[field].to(draw(st.sampled_from([torch.int32, torch.int64])))
    return rec, ("validate", "dtype"), field, "mismatch_kl_k3"


def other_device(rec, draw):
    field = draw(st.sampled_from(["sampler_logp", "trainer_logp", "entropy"]))
    rec[field] = torch.empty(rec["mask"].shape, device="meta")
    return rec, ("validate", "device"), field, "tokens"


def future_versions(rec, draw):
    version = rec["token_version"].clone()
    version[0] = rec["trainer_version"] + draw(st.integers(1, 100))
    rec["token_version"] = version
    rec["mask"] = rec["mask"].clone()
    rec["mask"][0, 0] = True
    return rec, ("validate", "negative_lag"), "token_version", "version_lag_mean"


def invalid_versions(rec, draw):
    version = rec["token_version"].to(torch.float64)
    version[0, 0] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), -3.0]))
    rec["token_version"] = version
    rec["mask"] = rec["mask"].clone()
    rec["mask"][0, 0] = True
    return rec, ("validate", "negative_lag"), "token_version", "version_lag_mean"


def group_mismatch(rec, draw):
    B = rec["mask"].shape[0]
    rec["group_ids"] = torch.arange(B) // 3          # groups of 3 while num_generations is 2
    return rec, ("validate", "group_size"), "group_ids", "groups"


def bad_env_labels(rec, draw):
    B = rec["mask"].shape[0]
    rec["env"] = draw(st.sampled_from([[i for i in range(B)], ["x" * 500] * B, [None] * B,
                                       [b"bytes"] * B, [3.5] * B]))
    return rec, ("validate", "label"), "env", "mismatch_kl_k3"


def many_envs(rec, draw):
    B = rec["mask"].shape[0]
    start = draw(st.integers(0, 10**9))
    rec["env"] = [f"env-{start + i}" for i in range(B)]
    return rec, None, "env", "mismatch_kl_k3"        # label_cap is counted once the cap is reached


def weird_labels(rec, draw):
    B = rec["mask"].shape[0]
    text = draw(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40))
    rec["env"] = [text + '"} injected{x="1', "line\nbreak\\", "ünïcödé ☃"] * B
    rec["env"] = rec["env"][:B]
    return rec, None, "env", "mismatch_kl_k3"


def unknown_field(rec, draw):
    rec["not_a_field"] = 1
    return rec, ("validate", "unknown_field"), "not_a_field", "mismatch_kl_k3"


FAULTS = [nan_logps, wrong_shape, wrong_length, empty_batch, all_masked, mask_dtype, other_dtype, other_device,
          future_versions, invalid_versions, group_mismatch, bad_env_labels, many_envs, weird_labels, unknown_field]


@st.composite
def malformed(draw):
    B = draw(st.integers(2, 6)) * 2
    T = draw(st.integers(1, 12))
    rec = base(B, T, draw(st.integers(0, 1000)))
    fault = draw(st.sampled_from(FAULTS))
    return (fault.__name__, *fault(rec, draw))


class Tally:
    examples = 0
    by_fault: Counter = Counter()


@pytest.fixture(scope="module")
def watch():
    w = rlwatch.Watch(run="fuzz", port=None, store=None, group_size=2, alerts=False)
    yield w
    w.close()


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(case=malformed())
def test_malformed_records_never_reach_the_trainer(watch, case):
    name, record, expected, field, still = case
    before = Counter(watch.errors.snapshot())
    values = watch.observe(Tally.examples, **record)           # must not raise
    after = Counter(watch.errors.snapshot())
    if expected is not None:
        assert after[expected] > before[expected], (name, expected, dict(after - before))
    if still is not None:
        assert values is not None and still in values, (name, still)
    if Tally.examples % 20 == 0:
        text = generate_latest(watch.registry).decode()
        families = {f.name for f in text_string_to_metric_families(text)}   # parses: the exposition is valid
        assert "rlwatch_hook_errors" in families
    Tally.examples += 1
    Tally.by_fault[name] += 1


@pytest.mark.slow
def test_every_kind_was_logged_once_and_exposition_passes_promtool(watch, caplog):
    if Tally.examples == 0:        # run alone (-k): the 10,000 cases first, on this module's Watch
        test_malformed_records_never_reach_the_trainer(watch=watch)
    assert Tally.examples >= 10_000, Tally.examples
    assert all(Tally.by_fault[f.__name__] > 100 for f in FAULTS), Tally.by_fault
    counts = watch.errors.snapshot()
    for kind in ("nonfinite_logp", "shape", "empty", "all_masked", "dtype", "type", "device", "negative_lag",
                 "group_size", "label", "label_cap", "unknown_field"):
        assert counts.get(("validate", kind), 0) > 0, kind
    assert watch.errors._logged == set(counts)             # the first of each kind was logged, once
    promtool = need_binary("promtool")
    text = generate_latest(watch.registry)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    envs = [line for line in text.decode().splitlines() if line.startswith("rlwatch_env_episodes{")]
    assert len(envs) <= 65                                  # 64 labels + "other", whatever was thrown at it


class _Lines(logging.Handler):
    lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        _Lines.lines.append(record.getMessage())


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(case=malformed())
def test_strict_mode_raises_a_specific_error_naming_the_field(case):
    name, record, expected, field, _ = case
    if expected is None:
        return                                   # legal labels: nothing to raise
    with rlwatch.Watch(run="strict", port=None, store=None, group_size=2, alerts=False, strict=True) as w:
        with pytest.raises(InvalidFieldError) as info:
            w.observe(0, **record)
    assert (info.value.field, info.value.kind) == (field, expected[1]), name


def test_one_clear_log_line_per_kind_naming_the_field():
    handler = _Lines()
    logger = logging.getLogger("rlwatch")
    logger.addHandler(handler)
    _Lines.lines = []
    w = rlwatch.Watch(run="log", port=None, store=None, group_size=2, alerts=False)
    try:
        for seed in range(3):
            rec = base(4, 6, seed)
            rec["trainer_logp"] = torch.zeros(5, 6)
            w.observe(seed, **rec)
            rec = base(4, 6, seed)
            rec["rewards"] = torch.zeros(7)
            w.observe(seed, **rec)
    finally:
        logger.removeHandler(handler)
        w.close()
    lines = [line for line in _Lines.lines if "rlwatch validate error" in line]
    assert len(lines) == 1                                   # one kind (shape): one line
    assert "'trainer_logp'" in lines[0] and "does not match mask" in lines[0]
    assert w.errors.counts[("validate", "shape")] == 6


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(labels=st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=60),
                       min_size=1, max_size=4),
       detector=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_label_values_cannot_inject_series_or_break_the_exposition(labels, detector):
    B = 4
    env = [labels[i % len(labels)] for i in range(B)]
    rec = base(B, 5, 0)
    rec.update(env=env, hacked={detector: torch.ones(B, dtype=torch.bool)}, failed=[labels[0] or None] * B)
    with rlwatch.Watch(run="inject", port=None, store=None, alerts=False) as w:
        w.observe(0, **rec)
        w.log_scalars(0, {labels[0]: 1.0})
        text = generate_latest(w.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("rlwatch_") for name in families)          # no injected metric names
    seen = {s.labels["env"] for s in families["rlwatch_env_episodes"].samples}
    expected = {(e[:120] if e else "default") for e in env}
    assert seen == expected                                                # exactly the labels given
    runs = {s.labels["run"] for f in families.values() for s in f.samples}
    assert runs == {"inject"}


# --- every string field with the full Unicode range, every dtype where a number is expected ----------

#: Any code point, with lone surrogates and C0/C1 control characters drawn often on purpose.
ANY_CHAR = st.one_of(st.characters(min_codepoint=0, max_codepoint=0x10FFFF),
                     st.integers(0xD800, 0xDFFF).map(chr), st.integers(0, 0x1F).map(chr),
                     st.integers(0x7F, 0x9F).map(chr), st.sampled_from(list('"\\{}<>&|=\n\r\t')))
ANY_TEXT = st.text(alphabet=ANY_CHAR, min_size=0, max_size=30)


def _constructible_dtypes() -> list[torch.dtype]:
    out = []
    for dtype in {d for d in vars(torch).values() if isinstance(d, torch.dtype)}:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")              # complex32 is "experimental"
                torch.tensor(1).to(dtype).item()
            out.append(dtype)
        except Exception:  # noqa: BLE001 - quantized, sub-byte and packed dtypes hold no scalars
            continue
    return sorted(out, key=str)


DTYPES = _constructible_dtypes()


@st.composite
def number_like(draw):
    """A number as a trainer may pass it: Python, 0-d or one-element tensor of any dtype, numpy."""
    value = draw(st.one_of(st.integers(-3, 100), st.floats(allow_nan=True, allow_infinity=True)))
    kind = draw(st.sampled_from(["python", "tensor0d", "tensor1", "numpy"]))
    if kind == "python":
        return value
    if kind == "numpy":
        import numpy as np

        return np.float32(value) if isinstance(value, float) else np.int64(value)
    dtype = draw(st.sampled_from(DTYPES))
    try:
        t = torch.tensor(value).to(dtype)
    except Exception:  # noqa: BLE001 - e.g. inf into an integer dtype
        t = torch.tensor(1).to(dtype)
    return t if kind == "tensor0d" else t.reshape(1)


class StringTally:
    examples = 0
    observed = 0


@pytest.fixture(scope="module")
def any_string_watch(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "strings.db")
    w = rlwatch.Watch(run="fuzz\udcff\x00", port=0, store=path, alerts=True, framework="f\ud800",
                      metadata={"k\udcff": "v\x1b"})
    yield w
    w.close()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(env=st.lists(ANY_TEXT, min_size=1, max_size=4), failed=ANY_TEXT, detector=ANY_TEXT, mode=ANY_TEXT,
       scalar=ANY_TEXT, note=st.tuples(ANY_TEXT, ANY_TEXT), path=ANY_TEXT,
       numbers=st.fixed_dictionaries({k: number_like() for k in ("trainer_version", "temperature", "top_p", "top_k",
                                                                   "scalar", "reward", "step")}),
       prompt=ANY_TEXT)
def test_any_string_and_any_number_type_never_breaks_labels_store_or_scrapes(any_string_watch, env, failed, detector,
                                                                            mode, scalar, note, path, numbers,
                                                                            prompt):
    import urllib.request

    w = any_string_watch
    B = 4
    rec = base(B, 5, StringTally.examples)
    rec.update(env=[env[i % len(env)] for i in range(B)], failed=[failed or None, None, failed, None],
               hacked={detector: torch.tensor([True, False, True, False])}, logprobs_mode=mode,
               trainer_version=numbers["trainer_version"], temperature=numbers["temperature"],
               top_p=numbers["top_p"], top_k=numbers["top_k"],
               episodes=[dict(prompt=prompt, response=prompt[::-1], env=env[0], reward=numbers["reward"])
                         for _ in range(B)])
    step = StringTally.examples
    if w.observe(step, **rec) is not None:
        StringTally.observed += 1
    w.observe(numbers["step"], **base(B, 5, 0)) if StringTally.examples % 10 == 0 else None
    w.log_scalars(step, {scalar: numbers["scalar"], "ok": 1.0})
    w.note(*note)
    w.record_checkpoint(step, path or ".", flush_timeout=5) if StringTally.examples % 25 == 0 else None
    if StringTally.examples % 15 == 0:
        with urllib.request.urlopen(w.url, timeout=10) as resp:
            assert resp.status == 200
            list(text_string_to_metric_families(resp.read().decode()))
    StringTally.examples += 1


@pytest.mark.slow
def test_after_any_strings_the_store_holds_every_step_and_nothing_failed_to_render(any_string_watch):
    from rlwatch.runs.store import StoreReader

    w = any_string_watch
    if StringTally.examples == 0:  # run alone (-k): the 300 cases first, on this module's Watch
        test_any_string_and_any_number_type_never_breaks_labels_store_or_scrapes(any_string_watch=w)
    assert StringTally.examples >= 300
    assert w.flush(30)
    counts = w.errors.snapshot()
    assert not [k for k in counts if k[0] in ("store", "export", "compute")], counts
    assert w.store.dropped == 0
    promtool = need_binary("promtool")
    text = generate_latest(w.registry)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    with StoreReader(w.store_path) as store:
        run = store.runs()[0]
        assert run == "fuzz\\udcff\x00"
        observed = len(store.steps(run)) + len(store.step_history(run))
        assert observed >= StringTally.observed
        for event in store.events(run):
            event["kind"].encode("utf-8"), event["detail"].encode("utf-8")
        for example in store.hack_examples(run):
            example["prompt"].encode("utf-8")
