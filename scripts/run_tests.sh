#!/usr/bin/env bash
# Run the whole test suite in the project's environment, in two pytest processes: the Triton
# kernel tests (interpreter mode, configured before any kernel is defined) and everything else.
# pytest's exit code 5 ("no tests were collected") means the suite is broken, so it is reported
# and turned into a failure. Extra arguments go to both runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECDIFF_VENV:-$ROOT/.venv}"
cd "$ROOT"
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
status=0
run() {
  # -P: the checkout's folders (triton_kernels/, training/, benchmarks/) must not shadow the
  # installed names (vllm_specdiff_kernels, ...); pyproject.toml sets --import-mode=importlib.
  "$VENV/bin/python" -P -m pytest -q -ra --durations=10 "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "run_tests: pytest collected no tests in: $*; the suite is broken" >&2
    rc=1
  fi
  [ "$rc" -eq 0 ] || status=$rc
}
run tests/kernels "$@"
# Tensor parallelism starts multi-process engines whose distributed state outlives them, which
# breaks later in-process engines: its test gets a process of its own too.
run tests --ignore=tests/engine/test_tensor_parallel.py "$@"
run tests/engine/test_tensor_parallel.py "$@"
exit "$status"
