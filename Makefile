# Two commands matter: `make demo` and `make test`. Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench deps clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

deps: $(STAMP)
	bash scripts/install-system-deps.sh

demo: deps
	$(BIN)/cubeaccel demo

test: deps
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider --durations=15; rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/store_bench.py

clean:
	rm -rf $(VENV)
