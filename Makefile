# trio-sidecar targets. Every target creates ./.venv and installs what it needs, so on a fresh machine with
# only Python 3.11+ `make install`, `make demo` and `make test` work as the first commands.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: install venv deps dynamo check test test-fast test-real demo bench fuzz protos dist check-dist clean

$(VENV)/bin/python:
	@echo "==> creating $(VENV) with $(PYTHON) and upgrading pip"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# From source, for use: trio-sidecar (editable) and Dynamo 1.6.1 (runtime, frontend, native sidecar).
$(VENV)/.stamp-install: pyproject.toml | $(VENV)/bin/python
	@echo "==> installing trio-sidecar from this checkout (editable) and its dependencies into $(VENV)"
	$(PIP) install --quiet -e .
	touch $@

install: $(VENV)/.stamp-install dynamo
	@echo "==> installed: $$($(VENV)/bin/trio-sidecar --version) with Dynamo 1.6.1 in $(VENV)"
	@echo "    use $(VENV)/bin/trio-sidecar, or \`source $(VENV)/bin/activate\` first"

# Core package + test extra (editable). Re-run when pyproject.toml changes.
$(VENV)/.stamp-deps: pyproject.toml | $(VENV)/bin/python
	@echo "==> installing trio-sidecar (editable) with its test extra into $(VENV) (about a minute)"
	$(PIP) install --quiet -e '.[test,mock]'
	touch $@

venv deps: $(VENV)/.stamp-deps

# Dynamo 1.6.1 (runtime bindings, frontend, native sidecar oracle). Never a plain `pip install ai-dynamo`:
# its aisimulate placeholder dependency downloads from a non-registry index (see the script).
$(VENV)/.stamp-dynamo: scripts/install-dynamo.sh | $(VENV)/bin/python
	bash scripts/install-dynamo.sh $(PY)
	touch $@

dynamo: $(VENV)/.stamp-dynamo

test: deps dynamo
	$(PY) -m pytest $(PYTEST_ARGS)

# Lint, format and types: ruff on the whole tree; mypy on the package (its --strict flags on the pure core).
check: deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test-fast: deps
	$(PY) -m pytest -x -q -m "not slow and not dynamo" $(PYTEST_ARGS)

# The real vLLM 0.32 CPU server as a conformance peer: provisioned once into a cache directory outside the
# tree (${TRIO_SIDECAR_CACHE:-~/.cache/trio-sidecar}/real-vllm, ~500 MB of registry downloads, ~2.5 min),
# then the `real_vllm` tests run against it (~1.5-4 min on 2 cores). Dynamo is needed for the differential
# (native sidecar vs trio-sidecar through dynamo.frontend on the real server).
test-real: deps dynamo
	eval "$$(bash scripts/real-vllm.sh --env)" && $(PY) -m pytest -m real_vllm tests/real_vllm $(PYTEST_ARGS)

demo: deps dynamo
	$(PY) examples/demo.py

bench: deps dynamo
	$(PY) bench/transport.py
	$(PY) bench/mock.py
	$(PY) bench/sidecar.py
	$(PY) bench/e2e.py

# Long property-based profile (>= 10,000 examples per property).
fuzz: deps
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests -k "property" $(PYTEST_ARGS)

protos: deps
	$(PY) scripts/gen_protos.py

# The wheel and sdist in ./dist, then the wheel installed into a clean venv: `trio-sidecar --version` and the
# mock started and stopped (scripts/check-dist.sh; CI runs it).
dist check-dist: deps
	bash scripts/check-dist.sh $(PY) dist

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
