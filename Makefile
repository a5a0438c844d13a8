# pdserve: the two commands a newcomer needs are `make up` and `make test`.
PY ?= python3
PYTEST_ARGS ?=

.PHONY: setup up test bench

setup:
	bash scripts/setup.sh

up: setup
	$(PY) -m pdserve.cli up --demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) -m pdserve.cli bench
