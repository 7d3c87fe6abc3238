# The two set-up commands of the README:
#   make demo   installs rlwatch (CPU torch when torch is absent) and runs the demo
#   make test   also installs the servers and frameworks the tests use, then runs the whole suite
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

.PHONY: demo test servers check bench clean openrlhf-venv test-openrlhf dist

$(VENV)/.base: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(PIP) -e '.[report]'
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) -e '.[dev,otel,report,trl,verl]'
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/rlwatch demo

servers:
	scripts/install-servers.sh

# The suites run in a network namespace with loopback only (scripts/loopback-only.sh): nothing a test
# starts, Ray's processes included, can listen beyond 127.0.0.1.
test: servers $(VENV)/.dev openrlhf-venv
	RLWATCH_REQUIRE_SERVERS=1 RLWATCH_REQUIRE_FRAMEWORKS=1 scripts/loopback-only.sh $(PY) -m pytest -q \
		--ignore=tests/test_openrlhf.py
	$(MAKE) test-openrlhf

# OpenRLHF 0.11 (CPU torch, no flash-attn/vllm) in its own virtual environment; idempotent.
openrlhf-venv:
	VENV=$(OPENRLHF_VENV) PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX=$(TORCH_INDEX) \
		scripts/setup-openrlhf-venv.sh

test-openrlhf: openrlhf-venv
	RLWATCH_REQUIRE_FRAMEWORKS=1 scripts/loopback-only.sh $(OPENRLHF_VENV)/bin/python -m pytest -q tests/test_openrlhf.py

# The generated files (alert rules, runbook, promtool tests, dashboards) match their generators.
check: $(VENV)/.base
	$(PY) -m rlwatch.alerts.render --check
	$(PY) dashboards/generate.py --check

# setuptools' PEP 517 hooks directly (no `build` package needed); the wheel carries alerts/, dashboards/
# and examples/ as rlwatch/_data (setup.py).
dist: $(VENV)/.dev
	rm -rf dist build
	$(PY) -c "from setuptools import build_meta as b; print(b.build_sdist('dist')); print(b.build_wheel('dist'))"

bench: $(VENV)/.dev
	$(PY) bench/bench_signals.py

clean:
	rm -rf $(VENV) $(OPENRLHF_VENV) rlwatch-runs rlwatch-demo .pytest_cache dist build *.egg-info
