# The two set-up commands of the README:
#   make demo   installs rlwatch (CPU torch when torch is absent) and runs the demo
#   make test   also installs the servers and frameworks the tests use, then runs the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test servers check bench clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) torch==$(TORCH_VERSION)
	$(PIP) -e '.[report]'
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) -e '.[dev,otel,report,trl,verl]'
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/rlwatch demo

servers:
	scripts/install-servers.sh

test: servers $(VENV)/.dev
	RLWATCH_REQUIRE_SERVERS=1 RLWATCH_REQUIRE_FRAMEWORKS=1 $(PY) -m pytest -q

bench: $(VENV)/.dev
	$(PY) bench/bench_signals.py

clean:
	rm -rf $(VENV) rlwatch-runs rlwatch-demo .pytest_cache
