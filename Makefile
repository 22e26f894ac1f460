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

.PHONY: setup browser llamacpp-converter run test lint format docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Setting up $(VENV) (first run takes a few minutes; log in $(LOG))..."
	@: > $(LOG)
	@$(PIP) install torch==2.13.0 $(QUIET)
	@$(PIP) install -e '.[dev,docs,ray]' $(QUIET)
	@$(PY) -c "import torch, transformers, tokenwise" $(QUIET)
	@touch $(STAMP)

# The web page's browser test drives Debian's chromium through its chromedriver: installed here
# when missing and possible (root with apt-get). It adds about 20 s to a first setup (measured:
# apt-get update + install, downloads included), nothing once installed. Elsewhere the test
# skips with the reason, and fails under CI (CI=true) rather than pass without a browser.
BROWSER_LOG := $(VENV)/browser-install.log
browser: $(STAMP)
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		start=$$(date +%s); \
		echo "Installing chromium and chromium-driver for the browser test (log in $(BROWSER_LOG))..."; \
		( apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq chromium chromium-driver ) >$(BROWSER_LOG) 2>&1 \
			|| { tail -n 20 $(BROWSER_LOG); exit 1; }; \
		echo "chromium installed in $$(( $$(date +%s) - start )) s"; \
	else \
		echo "note: chromium/chromedriver are missing and this user cannot apt-get them;" \
			"the browser test will be skipped (and fail under CI)"; \
	fi

# llama.cpp's converter (convert_hf_to_gguf.py, from the llama-cpp-python sdist) for the GGUF
# tests that check our writer against it: fetched once into ~/.cache/tokenwise/llamacpp (12-26 s
# measured on a shared VM: a 77 MB download and its unpacking), nothing once there. Without
# network the tests skip; under CI (CI=true) this step fails instead.
llamacpp-converter: $(STAMP)
	@$(PY) -m tokenwise.tools.llamacpp_source $(if $(filter true,$(CI)),--required)

run: setup
	@$(VENV)/bin/tokenwise generate "def fibonacci(n):" "def read_config(path):" --max-tokens 40 --stream

test: setup browser llamacpp-converter
	@$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/ruff check .

format: setup
	@$(VENV)/bin/ruff format .
	@$(VENV)/bin/ruff check --fix .

# The documentation site (mkdocs.yml: README + docs/ + benchmarks' results) into site/. --strict
# fails on a dead link; the test suite runs the same build (tests/test_docs.py).
docs: setup
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	@echo "site built: open site/index.html"

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache site
