#!/usr/bin/env bash
# Run the whole test suite in the project's environment. pytest's exit code 5 ("no tests were
# collected") means the suite is broken, so it is reported and turned into a failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECDIFF_VENV:-$ROOT/.venv}"
cd "$ROOT"
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
"$VENV/bin/python" -m pytest -q -ra --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; the suite is broken" >&2
  exit 1
fi
exit "$rc"
