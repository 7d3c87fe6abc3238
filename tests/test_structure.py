"""The house rules of issue 14 that a test can hold: one home for the options and the RLWATCH_*
variables, one "never raise" policy, and the step's stages in a fixed order."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import rlwatch
from rlwatch.config import WatchConfig, env_watch_options
from rlwatch.errors import HookErrors, InvalidFieldError, guard, guarded

from .conftest import make_step

PACKAGE = Path(rlwatch.__file__).parent
#: Reading a variable (not copying the environment for a child process).
READS_ENV = re.compile(r"os\.environ\.get\((?!\"PYTHONPATH\")|os\.environ\[|os\.getenv|env_flag\(os\.environ|os\.environ if ")
#: Files allowed to read the environment besides rlwatch/config.py: none.
PENDING: set[str] = set()


def test_watch_config_has_every_constructor_argument_with_the_same_default():
    params = dict(inspect.signature(rlwatch.Watch.__init__).parameters)
    params.pop("self")
    config = {f: getattr(WatchConfig(), f) for f in WatchConfig.names()}
    assert set(params) == set(config)
    assert {name: p.default for name, p in params.items()} == config


def test_only_config_reads_the_environment():
    readers = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if READS_ENV.search(p.read_text())}
    assert readers - PENDING == {"config.py"}


def test_env_watch_options_parse_the_shared_variables():
    env = {"RLWATCH_RUN": "r", "RLWATCH_PORT": "off", "RLWATCH_STORE": "0", "RLWATCH_GROUP_SIZE": "8",
           "RLWATCH_PORT_FALLBACK": "no", "RLWATCH_STRICT": "1"}
    assert env_watch_options(env) == {"run": "r", "port": None, "store": None, "group_size": 8,
                                      "port_fallback": False, "strict": True}


@pytest.mark.parametrize("strict", [False, True])
def test_guard_counts_each_error_once_and_raises_only_in_strict_mode(strict):
    errors = HookErrors(strict=strict)

    def fails():
        raise ZeroDivisionError("x")

    def reported_then_raised():          # what RecordBuilder does: report, which raises in strict mode
        errors.report("validate", "shape", "bad", field="rewards")

    for func, expected in ((fails, ("compute", "ZeroDivisionError")), (reported_then_raised, ("validate", "shape"))):
        if strict:
            with pytest.raises((ZeroDivisionError, InvalidFieldError)):
                guard(errors, "compute", None, func)
        else:
            assert guard(errors, "compute", None, func) is None
        assert errors.snapshot()[expected] == 1
    assert errors.total() == 2
    decorated = guarded(lambda: errors, "integration", "hook")(fails)
    if strict:
        with pytest.raises(ZeroDivisionError):
            decorated()
    else:
        assert decorated() is None
    assert errors.snapshot()[("integration", "hook")] == 1


def test_the_alert_evaluator_runs_after_every_listener_even_one_added_later():
    calls = []

    class Appended:
        def on_step(self, step, values):
            calls.append("listener")

        def close(self):
            pass

    with rlwatch.Watch(run="order", port=None, store=None, alerts=True, strict=True) as watch:
        evaluate = watch.evaluator.on_step
        watch.evaluator.on_step = lambda step, values: (calls.append("evaluator"), evaluate(step, values))[1]
        watch.listeners.append(Appended())        # appended after the evaluator was started
        watch.observe(0, **make_step(seed=1))
    assert calls == ["listener", "evaluator"]


#: Modules allowed over 500 lines: the alert catalogue (data) and the integrations (issue 14's other part).
LONG_ALLOWED = {"alerts/catalogue.py"}


def test_no_module_over_500_lines_and_a_thin_watch():
    import ast

    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500 and p.parent.name != "integrations"}
    assert set(long) <= LONG_ALLOWED, long
    tree = ast.parse((PACKAGE / "watch.py").read_text())
    (watch,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Watch"]
    assert watch.end_lineno - watch.lineno + 1 <= 230          # was 281; its docstring is 55 of them
