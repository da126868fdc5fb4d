# The README's commands. `make demo` and `make test` set up everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KVWARM := $(VENV)/bin/kvwarm
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# `make test` runs the suite on this many worker processes (pytest-xdist; 1: one
# process). Two on the 2-core machines CI runs on: 394 s against 698 s in one process,
# every test passing either way (2026-12-07). Each worker that runs Kafka tests starts a
# broker of its own.
PYTEST_WORKERS ?= 2

.PHONY: demo test chaos lint format bench install clean system-deps kafka-jars readme-check

# Installing twice is fast: the stamp is newer than pyproject.toml unless it changed.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

system-deps:
	@bash scripts/system-deps.sh

install: system-deps $(STAMP)

demo: install
	$(KVWARM) demo

# Apache Kafka's broker jars from Maven Central into .cache/kafka (a second run only checks).
kafka-jars: install
	$(KVWARM) kafka fetch

test: install kafka-jars
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The chaos and fuzz suite alone (issue 18); `make test` runs it too.
chaos: install kafka-jars
	$(PY) -m pytest -m chaos -s $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check features predictor training serving executor benchmarks devtools tests
	$(VENV)/bin/ruff format --check features predictor training serving executor benchmarks devtools tests
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format features predictor training serving executor benchmarks devtools tests
	$(VENV)/bin/ruff check --fix features predictor training serving executor benchmarks devtools tests

# Every bash block of README.md run as written, replay and demo included (make test runs the quick ones).
readme-check: install kafka-jars
	$(PY) scripts/readme_check.py

bench: install
	$(KVWARM) bench all

clean:
	rm -rf $(VENV) .cache build *.egg-info
