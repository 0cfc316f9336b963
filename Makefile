# trio-sidecar developer targets. Every target creates ./.venv and installs what it needs, so on a fresh
# machine with only Python 3.11+ `make demo` and `make test` work as the first two commands.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: venv deps dynamo test test-fast test-real demo bench fuzz protos clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Core package + test extra (editable). Re-run when pyproject.toml changes.
$(VENV)/.stamp-deps: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e '.[test]'
	touch $@

venv deps: $(VENV)/.stamp-deps

# Dynamo 1.6.1 (runtime bindings, frontend, native sidecar oracle). Never a plain `pip install ai-dynamo`:
# its aisimulate placeholder dependency downloads from a non-registry index (see the script).
$(VENV)/.stamp-dynamo: scripts/install-dynamo.sh | $(VENV)/.stamp-deps
	bash scripts/install-dynamo.sh $(PY)
	touch $@

dynamo: $(VENV)/.stamp-dynamo

test: deps dynamo
	$(PY) -m pytest $(PYTEST_ARGS)

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

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
