"""The OpenRLHF integration against the real openrlhf package, without Ray: OpenRLHF's PolicyLoss
unchanged by the hook, the worker setup hook's imports, install and uninstall, version refusal, errors
counted, options from the environment, and the run against OpenRLHF 0.11.0 (see tests/test_openrlhf_ray.py
for how these tests run)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .conftest import REQUIRE_FRAMEWORKS, ROOT, need_module
# First: it puts the import stubs (and the 0.11.0 source) on the path, or skips without openrlhf.
from ._openrlhf_helpers import OLD_API, OLD_SOURCE, VERSION, minimal_args, versions

need_module("openrlhf")

from rlwatch import Watch  # noqa: E402
from rlwatch.integrations import openrlhf as ro  # noqa: E402

from . import _openrlhf_mini as mini  # noqa: E402


@versions
def test_policy_loss_is_the_same_with_the_hook_installed(tmp_path):
    from openrlhf.models import PolicyLoss

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 7, generator=g) * 3
    new, rollout = old + 0.1 * torch.randn(4, 7, generator=g), old + 0.2 * torch.randn(4, 7, generator=g)
    adv, mask = torch.randn(4, 7, generator=g), torch.rand(4, 7, generator=g) > 0.2
    kwargs = dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 5.0]) if OLD_API else \
        dict(is_correction_level="token")
    before = PolicyLoss(**kwargs)(new, old, adv, action_mask=mask, rollout_log_probs=rollout)
    w = Watch(run="loss", port=None, store=None, strict=True, alerts=False)
    assert ro.instrument(watch=w)
    try:
        import openrlhf.trainer.ppo_trainer  # noqa: F401 - every wrapped module loaded
        import openrlhf.trainer.ppo_utils.samples_generator  # noqa: F401

        after = PolicyLoss(**kwargs)(new, old, adv, action_mask=mask, rollout_log_probs=rollout)
    finally:
        ro.uninstrument()
        w.close()
    assert len(before) == len(after) == (4 if OLD_API else 5)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_setup_hook_imports_neither_openrlhf_nor_torch():
    """The worker setup hook only registers the import hook: it imports neither OpenRLHF nor torch."""
    code = ("import sys; import rlwatch.integrations.openrlhf as ro; ro.setup_hook(); "
            "print(any(m == 'openrlhf' or m.startswith('openrlhf.') for m in sys.modules), "
            "'torch' in sys.modules, ro.INSTRUMENTOR.is_instrumented)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    imported, torch_loaded, instrumented = out.stdout.split()
    assert (imported, torch_loaded, instrumented) == ("False", "False", "True"), out.stderr


# --- life cycle ----------------------------------------------------------------------------------

def _targets() -> dict:
    from openrlhf.datasets import prompts_dataset
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ppo_utils import experience_maker, samples_generator

    modules = {ro.EXPERIENCE_MAKER: experience_maker, ro.PPO_TRAINER: ppo_trainer,
               ro.SAMPLES_GENERATOR: samples_generator, ro.PROMPTS_DATASET: prompts_dataset}
    return {(name, cls, attr): vars(getattr(modules[name], cls))[attr]
            for name, entries in ro.PATCHES.items() for cls, attr, _ in entries}


def test_idempotent_and_uninstrument_restores_originals(caplog):
    originals = _targets()
    assert not any(hasattr(f, "__rlwatch_original__") for f in originals.values())
    w = Watch(run="life", port=None, store=None, alerts=False)
    try:
        assert ro.instrument(watch=w)
        wrapped = _targets()
        assert all(wrapped[k].__rlwatch_original__ is originals[k] for k in originals)
        with caplog.at_level(logging.WARNING, logger="rlwatch"):
            assert not ro.instrument(watch=w)                        # second call: warns, nothing patched
        assert sum("already instrumented" in r.getMessage() for r in caplog.records) == 1
        assert _targets() == wrapped
        ro.setup_hook()                                              # a no-op when already instrumented
        assert _targets() == wrapped
    finally:
        ro.uninstrument()
        w.close()
    assert _targets() == originals
    from rlwatch.integrations._imports import PostImportFinder

    assert not any(isinstance(f, PostImportFinder) for f in sys.meta_path)


@pytest.mark.parametrize("version", ["0.10.4", "0.12.0", "1.0.0"])
def test_other_openrlhf_versions_are_refused_with_one_warning(monkeypatch, caplog, version):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "openrlhf" else real(name))
    originals = _targets()
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        assert not ro.instrument()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and version in warnings[0] and ">=0.11,<0.12" in warnings[0]
    assert not ro.INSTRUMENTOR.is_instrumented and _targets() == originals


def test_a_release_without_a_patched_method_is_refused_with_one_warning(monkeypatch, caplog):
    """As if a release renamed ``SamplesGenerator._dispatch_prompts_to_vllm``: one line names it, nothing is
    patched and the run goes on unwatched (not with the version stamps missing)."""
    from openrlhf.trainer.ppo_utils import samples_generator

    originals = _targets()
    monkeypatch.delattr(samples_generator.SamplesGenerator, "_dispatch_prompts_to_vllm")
    with caplog.at_level(logging.WARNING, logger="rlwatch"):
        assert not ro.instrument(watch=Watch(run="renamed", port=None, store=None, alerts=False))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"has no {ro.SAMPLES_GENERATOR}.SamplesGenerator._dispatch_prompts_to_vllm" \
        in warnings[0] and "unwatched" in warnings[0], warnings
    assert not ro.INSTRUMENTOR.is_instrumented
    monkeypatch.undo()
    assert _targets() == originals


def test_errors_are_counted_never_raised():
    """A malformed Experience (trainer log-probs wider than the mask) reaching the wrapper: OpenRLHF
    gets its result back untouched; rlwatch counts the error (default, non-strict Watch)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    w = Watch(run="errors", port=None, store=None, alerts=False)
    assert ro.instrument(watch=w)
    try:
        broken = Experience(action_mask=torch.ones(2, 3), action_log_probs=torch.zeros(2, 5), index=[0, 1])
        make_experience_batch = ro.INSTRUMENTOR._wrap_make_experience_batch(lambda self, samples: [broken])
        assert make_experience_batch(SimpleNamespace(args=minimal_args()), []) == [broken]
        assert w.errors.total() >= 1
    finally:
        ro.uninstrument()
        w.close()


def test_watch_options_from_env():
    is_flags = ["--algo.advantage.is_correction_enable"] if OLD_API else ["--algo.advantage.is_correction_level", "seq"]
    args = minimal_args("--rollout.n_samples_per_prompt", "8", "--logger.wandb.run_name", "wb", *is_flags,
                        "--algo.advantage.is_correction_threshold", "0.25", "4")
    opts = ro.watch_options_from_env({"RLWATCH_PORT": "none", "RLWATCH_STORE": "off"}, args)
    assert opts["run"] == "wb" and opts["port"] is None and opts["store"] is None
    assert opts["group_size"] == 8 and opts["mis_band"] == (0.25, 4.0) and opts["framework"] == "openrlhf"
    assert ro.watch_options_from_env({"RLWATCH_RUN": "env", "RLWATCH_GROUP_SIZE": "0"}, args)["run"] == "env"
    assert "group_size" not in ro.watch_options_from_env({"RLWATCH_GROUP_SIZE": "0"}, args)
    assert ro.checkpoint_dir(args, 4).endswith(os.path.join("_actor", "global_step4"))


# --- OpenRLHF 0.11.0 ------------------------------------------------------------------------------

def test_version_sensitive_tests_pass_on_openrlhf_0_11_0():
    """The tests marked openrlhf_versions, again against OpenRLHF 0.11.0 (PolicyLoss returns four
    values, ``is_correction_enable`` instead of ``is_correction_level``, no finish reason from the
    multi-turn agent executor) in a subprocess, with the 0.11.0 source first on the path."""
    if OLD_SOURCE:
        pytest.skip("already running against the old source")
    old = Path(sys.prefix) / "openrlhf-0.11.0"
    if not (old / "openrlhf" / "__init__.py").exists():
        if REQUIRE_FRAMEWORKS:
            pytest.fail(f"{old} missing: run scripts/setup-openrlhf-venv.sh")
        pytest.skip(f"{old} missing: run scripts/setup-openrlhf-venv.sh")
    env = dict(os.environ, RLWATCH_OPENRLHF_SOURCE=str(old))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "openrlhf_versions",
                          *sorted(str(p) for p in Path(__file__).parent.glob("test_openrlhf*.py")),
                          "-W", "ignore::DeprecationWarning"],
                         capture_output=True, text=True, timeout=400, cwd=str(ROOT), env=env)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "8 passed" in summary and "skipped" not in summary and "deselected" in summary, out.stdout[-2000:]


@versions
def test_running_against_the_expected_version():
    import openrlhf

    if OLD_SOURCE:
        assert VERSION == "0.11.0" and openrlhf.__file__.startswith(OLD_SOURCE)
    else:
        assert VERSION is not None and VERSION.startswith("0.11.") and not OLD_API


@versions
def test_example_launch_line_parses_with_openrlhfs_own_parser(tmp_path):
    """examples/openrlhf_launch.sh: its runtime env names the hook and its arguments pass OpenRLHF's
    argument parser and checks (the run itself needs GPUs)."""
    args_file = tmp_path / "args"
    out = subprocess.run(["bash", str(ROOT / "examples" / "openrlhf_launch.sh")], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, RLWATCH_EXAMPLE_PRINT="1", RLWATCH_RUN="example",
                                              RLWATCH_EXAMPLE_ARGS_FILE=str(args_file)))
    assert out.returncode == 0, out.stderr
    runtime_env = json.loads(out.stdout)
    assert runtime_env["worker_process_setup_hook"] == ro.HOOK
    assert runtime_env["env_vars"]["RLWATCH_RUN"] == "example"
    argv = args_file.read_text().split("\0")[:-1]
    if OLD_API:        # the one flag that 0.11.0 spells differently (as the example's comment says)
        i = argv.index("--algo.advantage.is_correction_level")
        argv[i:i + 2] = ["--algo.advantage.is_correction_enable"]
    args = mini.parse_args(argv)
    assert ro.is_correction_on(args) and args.rollout.n_samples_per_prompt == 8
    assert ro.watch_options_from_env({}, args)["group_size"] == 8
    assert ro.checkpoint_dir(args, 20).endswith("global_step20_hf")
