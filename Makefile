# Two commands for a newcomer: `make run` and `make test`. Every target is idempotent and
# creates .venv on first use (torch==2.13.0 first: it is the CPU wheel this machine provides).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenwise-installed
PIP := $(PY) -m pip --disable-pip-version-check -q
# Installer output goes to a log that is shown only when a step fails.
LOG := $(VENV)/install.log
QUIET = >>$(LOG) 2>&1 || (cat $(LOG); exit 1)

.PHONY: setup run test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Setting up $(VENV) (first run takes a few minutes; log in $(LOG))..."
	@: > $(LOG)
	@$(PIP) install torch==2.13.0 $(QUIET)
	@$(PIP) install -e '.[dev]' $(QUIET)
	@$(PY) -c "import torch, transformers, tokenwise" $(QUIET)
	@touch $(STAMP)

run: setup
	@$(VENV)/bin/tokenwise generate "def fibonacci(n):" "def read_config(path):" --max-tokens 40 --stream

test: setup
	@$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/ruff check .

format: setup
	@$(VENV)/bin/ruff format .
	@$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
