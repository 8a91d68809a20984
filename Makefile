# pdstack: `make test` builds the virtual environment from nothing and runs lint, type checks and the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv host lint typecheck test test-unit up down clean

venv: $(STAMP)

$(STAMP): pyproject.toml serving/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[infra,ansible,plot,dev]' -e 'serving[parity]'
	touch $@

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check pdstack

typecheck: venv
	$(VENV)/bin/mypy
	# The Pulumi program against the provider SDKs' own types: a misspelled argument fails the build.
	$(VENV)/bin/basedpyright --pythonpath $(PY)

test: lint typecheck
	$(VENV)/bin/pytest

test-unit: venv
	$(VENV)/bin/pytest tests/unit

host:
	bash scripts/host-setup.sh

up: venv host
	$(VENV)/bin/pdstack local up

down: venv
	$(VENV)/bin/pdstack local down

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
