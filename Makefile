# The two commands the README documents (each creates the environment it needs):
#   make demo   - create .venv and run the main job: a short Tree-LSTM training demo
#   make test   - create .venv and run lint, type checks and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchfold-installed
DEMO_ARGS ?=

.PHONY: demo test lint typecheck unit env clean

env: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,notebooks]'
	touch $@

demo: env
	$(BIN)/python -m torchfold demo $(DEMO_ARGS)

lint: env
	$(BIN)/ruff check torchfold tests benchmarks scripts
	$(BIN)/ruff format --check torchfold tests benchmarks scripts

typecheck: env
	$(BIN)/mypy

unit: env
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
