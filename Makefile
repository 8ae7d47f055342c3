# Two entry points: `make demo` and `make test`. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0


.PHONY: demo test lint typecheck pytest venv clean bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/liveloop demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict

pytest: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/judge.py
	$(BIN)/python bench/swap.py

clean:
	rm -rf $(VENV) .liveloop .pytest_cache .mypy_cache .ruff_cache
