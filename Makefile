# The README's commands. `make demo` and `make test` set up everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KVWARM := $(VENV)/bin/kvwarm
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint format bench install clean system-deps kafka-jars

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
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check features predictor training serving executor benchmarks devtools tests
	$(VENV)/bin/ruff format --check features predictor training serving executor benchmarks devtools tests
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format features predictor training serving executor benchmarks devtools tests
	$(VENV)/bin/ruff check --fix features predictor training serving executor benchmarks devtools tests

bench: install
	$(KVWARM) bench all

clean:
	rm -rf $(VENV) .cache build *.egg-info
