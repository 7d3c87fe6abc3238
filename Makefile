# The two set-up commands of the README:
#   make demo   installs rlwatch (CPU torch when torch is absent) and runs the demo
#   make check  the fast local loop: lint, the generated files (the demo's block in README.md and docs/results.md
#               included: scripts/demo_block.py runs the demo), the tests that need no server or framework
#   make generate  rewrites every generated file (scripts/generate.py; `make check` names a stale one)
#   make test   also installs the servers and frameworks the tests use, then lints and runs the whole suite
#               (OpenRLHF's tests in their own environment, .venv-openrlhf: its pins conflict with TRL/verl;
#               tests/test_packaging.py builds the sdist and wheel and runs them from a fresh venv)
#   make dist   the sdist and the wheel of the distribution rlwatch-llm, in dist/
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where pip would otherwise fetch a CUDA build of torch from PyPI:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP := $(PY) -m pip install -q --disable-pip-version-check
OPENRLHF_VENV ?= .venv-openrlhf

.PHONY: demo test lint servers check generate bench clean openrlhf-venv test-openrlhf dist

$(VENV)/.base: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(PIP) -e '.[report]'
	touch $@

# pytest and ruff (the dev extra), without the frameworks: what `make check` needs.
$(VENV)/.check: $(VENV)/.base
	$(PIP) -e '.[dev]'
	touch $@

$(VENV)/.dev: $(VENV)/.check
	$(PIP) -e '.[dev,otel,report,trl,verl]'
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/rlwatch demo

servers:
	scripts/install-servers.sh

# The suites run in a network namespace with loopback only (scripts/loopback-only.sh): nothing a test
# starts, Ray's processes included, can listen beyond 127.0.0.1.
# ruff with the rules of pyproject.toml ([tool.ruff]); the first step of `make test` and `make check`.
lint: $(VENV)/.check
	$(VENV)/bin/ruff check .

test: lint servers $(VENV)/.dev openrlhf-venv
	RLWATCH_REQUIRE_SERVERS=1 RLWATCH_REQUIRE_FRAMEWORKS=1 scripts/loopback-only.sh $(PY) -m pytest -q \
		--ignore-glob="tests/test_openrlhf*.py"
	$(MAKE) test-openrlhf

# OpenRLHF 0.11 (CPU torch, no flash-attn/vllm) in its own virtual environment; idempotent.
openrlhf-venv:
	VENV=$(OPENRLHF_VENV) PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX=$(TORCH_INDEX) \
		scripts/setup-openrlhf-venv.sh

test-openrlhf: openrlhf-venv
	RLWATCH_REQUIRE_FRAMEWORKS=1 scripts/loopback-only.sh $(OPENRLHF_VENV)/bin/python -m pytest -q tests/test_openrlhf*.py

# Every generated file rewritten by its generator (scripts/generate.py: alert rules, runbook, promtool tests,
# dashboards, the golden exposition, the demo's output quoted in README.md and docs/results.md).
generate: $(VENV)/.base
	$(PY) scripts/generate.py

# The fast local loop: lint, the generated files (alert rules, runbook, promtool tests, dashboards, the
# golden exposition, the demo's output quoted in README.md and docs/results.md: a demo run, ~10 s of
# training) match their generators (scripts/generate.py --check names the stale ones), and every test that needs no server binary and no framework and is not marked slow or perf
# (tests/conftest.py marks a test `servers` or `frameworks` from what it calls).
check: lint
	$(PY) scripts/generate.py --check
	$(PY) -m pytest -q -m "not servers and not frameworks and not slow and not perf"

# setuptools' PEP 517 hooks directly (no `build` package needed); the wheel carries alerts/, dashboards/
# and examples/ as rlwatch/_data (setup.py).
dist: $(VENV)/.dev
	rm -rf dist build
	$(PY) -c "from setuptools import build_meta as b; print(b.build_sdist('dist')); print(b.build_wheel('dist'))"

bench: $(VENV)/.dev
	$(PY) bench/bench_signals.py

clean:
	rm -rf $(VENV) $(OPENRLHF_VENV) rlwatch-runs rlwatch-demo .pytest_cache dist build *.egg-info
