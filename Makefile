# pdserve: the two commands a newcomer needs are `make up` and `make test`.
# Every target runs in the project's virtual environment, which scripts/setup.sh creates; python -P
# keeps the working directory off sys.path, where the checkout's operator/ folder would shadow the
# standard library's `operator`.
VENV ?= .venv
export PDSERVE_VENV := $(VENV)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
UP_ARGS ?=

.PHONY: setup setup-test up test test-fast bench

# serving only: Python dependencies and the default model (no Kubernetes tools, no test extras)
setup:
	bash scripts/setup.sh serve

# everything the test suite needs, the Kubernetes tools included
setup-test:
	bash scripts/setup.sh test

up: setup
	$(PY) -P -m pdserve.cli up --demo $(UP_ARGS)

test: setup-test
	$(PY) -P -m pytest $(PYTEST_ARGS)

# the inner loop: every test that takes no more than a few seconds (no model, no Kubernetes, no client peers)
test-fast:
	PDSERVE_SKIP_K8S=1 PDSERVE_SKIP_PEERS=1 bash scripts/setup.sh test
	$(PY) -P -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) -P -m pdserve.cli bench
