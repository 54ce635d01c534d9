# The two entry points of the README. Both build (or reuse) the environment first.
# SPECDIFF_VENV=DIR puts the virtual environment elsewhere (default: .venv in this checkout).
SPECDIFF_VENV ?= $(CURDIR)/.venv
export SPECDIFF_VENV
BIN := $(SPECDIFF_VENV)/bin

.PHONY: setup demo test lint

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/vllm-specdiff demo

lint: setup
	$(BIN)/ruff check .

test: lint
	bash scripts/run_tests.sh
