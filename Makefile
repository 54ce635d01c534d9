# The two entry points of the README. Both build (or reuse) the environment first.
# SPECDIFF_VENV=DIR puts the virtual environment elsewhere (default: .venv in this checkout).
SPECDIFF_VENV ?= $(CURDIR)/.venv
export SPECDIFF_VENV
BIN := $(SPECDIFF_VENV)/bin

.PHONY: setup demo test test-fast lint

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/vllm-specdiff demo

lint: setup
	$(BIN)/ruff check .

test: lint
	bash scripts/run_tests.sh

# A developer's loop, not CI: the tests that start no vLLM engine and import no vLLM (all but
# tests/engine, tests/e2e, tests/kernels and the tests marked `vllm`), less the few that spend
# a minute in subprocesses or long simulations (FAST_SKIP). `make test` runs every test.
FAST_SKIP := tests/test_cuda_paths.py::test_cpu_run_passes_every_check_and_writes_the_report \
	tests/test_packaging.py::test_console_scripts_run_outside_the_checkout \
	tests/core/test_reference_decoder.py::test_sampled_first_three_tokens_match_plain_sampling \
	tests/training/test_pipeline.py::test_training_imports_without_vllm \
	tests/adaptive/test_controller.py::test_one_row_stays_near_the_best_fixed_length_where_long_drafts_cost_a_step_more
test-fast: lint
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(BIN)/python -P -m pytest -q -m "not vllm and not slow" \
	  --ignore=tests/engine --ignore=tests/e2e $(addprefix --deselect ,$(FAST_SKIP)) tests
