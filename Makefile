# trio-sidecar developer targets. Every target creates ./.venv and installs what it needs, so on a fresh
# machine with only Python 3.11+ `make demo` and `make test` work as the first two commands.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: venv deps test test-fast demo bench fuzz protos clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Core package + test extra (editable). Re-run when pyproject.toml changes.
$(VENV)/.stamp-deps: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e '.[test]'
	touch $@

venv deps: $(VENV)/.stamp-deps

test: deps
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: deps
	$(PY) -m pytest -x -q -m "not slow" $(PYTEST_ARGS)

demo: deps
	$(PY) examples/embedded_stream.py

bench: deps
	$(PY) bench/transport.py

# Long property-based profile (>= 10,000 examples per property).
fuzz: deps
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests -k "property" $(PYTEST_ARGS)

protos: deps
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
