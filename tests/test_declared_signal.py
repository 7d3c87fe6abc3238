"""Issue 40: a token quantity with a threshold, declared in rlwatch/signals/quantities/tokens.py and nowhere
else (here by replacing the declaration tuples, as the block docs/adding-a-signal.md shows would), reaches
every consumer: each path of the engine (one pass at 64 positions, chunks, large CPU chunks at 8,192 and
524,288, compiled), StepValues, the Prometheus exposition, the catalogue, SignalConfig / WatchConfig /
Watch(<name>=...) with its range, RLWATCH_<NAME> and the runbook's "Signal settings"."""

from __future__ import annotations


import pytest
import torch

import rlwatch
import rlwatch.exporters.prometheus  # noqa: F401 - holds CATALOGUE from its import: imported before the patch
import rlwatch.hook.watch  # noqa: F401 - Watch.__init__'s signature is made at import: imported before the patch
from rlwatch.core import metrics
from rlwatch.core.config import WatchConfig, env_watch_options
from rlwatch.signals import SignalConfig
from rlwatch.signals import quantities as q
from rlwatch.signals.pending import _div

from tests.conftest import make_step, patch_catalogue
from tests.test_engine import _forget_compiled, run

SIZES = {64: (8, 8), 8_192: (64, 128), 524_288: (256, 2048)}


def declare(monkeypatch, token_sums=(), token_metrics=(), thresholds=(), terms=None) -> None:
    """What a declaration block in tokens.py adds, added to the package's tuples (which every reader
    reads), and the catalogue entries core.metrics makes from them given to every module holding it."""
    for name, term in (terms or {}).items():
        monkeypatch.setitem(q.TERMS, name, term)
    monkeypatch.setattr(q, "TOKEN_SUMS", q.TOKEN_SUMS + tuple(token_sums))
    monkeypatch.setattr(q, "METRICS", q.METRICS + tuple(token_metrics))
    monkeypatch.setattr(q, "SIGNAL_THRESHOLDS", q.SIGNAL_THRESHOLDS + tuple(thresholds))
    known = {spec.name for spec in metrics.CATALOGUE}
    specs = tuple(s for s in metrics.threshold_specs() + metrics.declared_specs() if s.name not in known)
    patch_catalogue(monkeypatch, specs)
    _forget_compiled()


@pytest.fixture
def far(monkeypatch):
    """``toy_far_ratio``: the fraction of valid tokens with |r| above the threshold ``far_nats`` (a count
    against its device constant), and ``toy_near_ratio``: below it (a term reading the constant)."""
    declare(monkeypatch,
            terms={"toy_near": lambda t: (t["abs_r"] < t["far_nats"]) * t["keep"]},      # 0 off the valid set
            token_sums=(q.TokenSum("n_far", "abs_r", against="far_nats"), q.TokenSum("n_near", "toy_near")),
            token_metrics=(q.Metric("toy_far_ratio", lambda f: _div(f.n_far, f.n), help="Tokens far.",
                                    section="mismatch"),
                           q.Metric("toy_near_ratio", lambda f: _div(f.n_near, f.n), help="Tokens near.",
                                    section="mismatch")),
            thresholds=(q.Threshold("far_nats", 0.5, "|r| above which a token is far.", above=0.0, high=50.0,
                                    device={"far_nats": float}),))
    yield
    _forget_compiled()


def _want(fields: dict, bound: float) -> dict[str, float]:
    r = fields["trainer_logp"].double() - fields["sampler_logp"].double()
    a = r[fields["mask"] & torch.isfinite(r)].abs()
    return {"toy_far_ratio": float((a > bound).double().mean()), "toy_near_ratio": float((a < bound).double().mean())}


def _check(values: dict, want: dict) -> None:
    for name, x in want.items():
        assert values[name][()] == pytest.approx(x, rel=1e-6), name


@pytest.mark.parametrize("bound", [None, 1.25])
@pytest.mark.parametrize("positions", SIZES)
def test_a_declared_threshold_signal_on_every_eager_path(far, positions, bound):
    B, T = SIZES[positions]
    fields = make_step(B=B, T=T, seed=positions, noise=1.0)
    config = SignalConfig() if bound is None else SignalConfig(far_nats=bound)
    want = _want(fields, 0.5 if bound is None else bound)
    assert 0.05 < want["toy_far_ratio"] < 0.95
    _check(rlwatch.compute(config, **fields), want)          # one pass, unstacked, or large CPU chunks
    if positions == 64:
        _check(run(fields, path="fused", config=config)[0], want)
        _check(run(fields, path="chunked", config=config)[0], want)


@pytest.mark.slow
def test_a_declared_threshold_signal_compiled(far):
    fields = make_step(B=8, T=8, seed=64, noise=1.0)
    for config, bound in ((SignalConfig(), 0.5), (SignalConfig(far_nats=1.25), 1.25)):
        values, ws = run(fields, path="compiled", config=config)
        assert ws.compiled_steps == 1
        _check(values, _want(fields, bound))


def test_a_declared_threshold_reaches_watch_values_exposition_and_overrides(far):
    from prometheus_client import generate_latest

    fields = make_step(B=6, T=10, seed=2, noise=1.0)
    with rlwatch.Watch(run="far", port=None, store=None, alerts=False, strict=True, far_nats=1.25) as watch:
        values = watch.observe(0, **fields)
        text = generate_latest(watch.registry).decode()
    want = _want(fields, 1.25)
    assert watch.signal_config.far_nats == watch.watch_config.far_nats == 1.25
    computed = rlwatch.compute(SignalConfig(far_nats=1.25), **fields)      # the same StepValues as observe
    assert isinstance(values, rlwatch.StepValues) and isinstance(computed, rlwatch.StepValues)
    for name, x in want.items():
        assert values.value(name) == pytest.approx(x, rel=1e-6) and computed.value(name) == values.value(name)
        assert f'rlwatch_{name}{{run="far",run_instance="{watch.run_instance}"}} ' in text
    assert f'rlwatch_far_nats{{run="far",run_instance="{watch.run_instance}"}} 1.25' in text
    assert "# HELP rlwatch_far_nats |r| above which a token is far." in text
    assert WatchConfig().far_nats == SignalConfig().far_nats == 0.5
    for bad in (0.0, -1.0, 51.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="far_nats"):
            rlwatch.Watch(run="far", port=None, store=None, far_nats=bad)
    with pytest.raises(TypeError, match="far_natz"):
        rlwatch.Watch(run="far", port=None, store=None, far_natz=1.0)
    assert env_watch_options({"RLWATCH_FAR_NATS": "2"})["far_nats"] == 2.0
    with pytest.raises(ValueError, match="RLWATCH_FAR_NATS"):
        env_watch_options({"RLWATCH_FAR_NATS": "0"})
    from rlwatch.alerts.render import signal_settings_md

    assert "| `far_nats` | 0.5 | (0, 50] | \\|r\\| above which a token is far. |" in signal_settings_md()


def test_the_declared_thresholds_are_the_keywords_with_their_defaults_and_checks():
    declared = {t.name: t.value for t in q.SIGNAL_THRESHOLDS}
    assert SignalConfig().thresholds == declared
    assert {name: getattr(WatchConfig(), name) for name in declared} == declared
    assert {"staleness_bound", "is_cap", "mis_band"} <= set(declared)
    for t in q.SIGNAL_THRESHOLDS:                 # every default is allowed by its own range
        assert t.check(t.value) == t.value, t.name
    assert SignalConfig(mis_band=[0.2, 2]).mis_band == (0.2, 2.0)
    for bad in ({"is_cap": 1.0}, {"mis_band": (1.0, 2.0)}, {"mis_band": (0.5, 1.0)}, {"mis_band": (0.5,)},
                {"staleness_bound": -1}):
        with pytest.raises(ValueError):
            SignalConfig(**bad)
    assert env_watch_options({"RLWATCH_MIS_BAND": "0.4, 6", "RLWATCH_IS_CAP": "3"}) == {
        "port_fallback": True, "strict": False, "mis_band": (0.4, 6.0), "is_cap": 3.0}
    assert [s.name for s in metrics.CATALOGUE if s.group == "config"][:4] == [
        "staleness_bound", "is_cap", "mis_low", "mis_high"]
    names = q.threshold_names()
    sums = [s.against for s in q.token_sums(False) if s.against]
    assert list(names[names.index(sums[0]):][:len(sums)]) == sums and names[-1] == "edges"


@pytest.mark.parametrize("missing", ["help", "section"])
def test_a_declaration_without_its_catalogue_entry_fails_at_import_naming_the_metric(tmp_path, missing):
    """A block of tokens.py that forgets ``help=`` (or ``section=``): importing the package raises, naming
    the metric, instead of computing a value the exposition leaves out."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    entry = {"help": 'help="Tokens far."', "section": 'section="mismatch"'}
    del entry[missing]
    tokens = (ROOT / "rlwatch" / "signals" / "quantities" / "tokens.py").read_text()
    (tmp_path / "tokens.py").write_text(tokens + f'\nMETRICS += (Metric("toy_far_ratio", lambda f: f.n, '
                                                  f'{", ".join(entry.values())}),)\n')
    probe = ("import sys, importlib.util as u, rlwatch.signals.quantities\n"       # then the edited module
             "spec = u.spec_from_file_location('rlwatch.signals.quantities.tokens', sys.argv[1])\n"
             "sys.modules[spec.name] = m = u.module_from_spec(spec); spec.loader.exec_module(m)\n")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "tokens.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0
    assert f"ValueError: metric 'toy_far_ratio' is declared without {missing}" in out.stderr, out.stderr[-2000:]
    with pytest.raises(ValueError, match="toy_far_ratio"):
        q.Metric("toy_far_ratio", lambda f: f.n, **({"section": "mismatch"} if missing == "help" else
                                                     {"help": "Tokens far."}))
