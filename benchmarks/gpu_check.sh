#!/usr/bin/env bash
# The GPU check, in one run of a few minutes on a machine with a CUDA GPU, torch, Triton,
# transformers, accelerate and peft but no vLLM and no network (vLLM's own paths need vLLM):
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
#   kernels_bf16.{json,md}  the kernel benchmark (benchmarks/kernels.py): Triton tree attention
#                           against SDPA with a dense mask, the fused draft log-probs against the
#                           unfused torch path, and the tree wrapper on vLLM's CUDA cache layouts
#                           (checked against the torch reference); bandwidth against the peak
#   cuda_paths.json         the core and the block-causal drafter with every tensor on the GPU
#                           (benchmarks/cuda_paths.py): greedy identity, sampled chi-square tests
#                           and their negative control, dispatch vs torch scoring, and the
#                           default-shaped drafter's milliseconds per step
#   pytest.{txt,xml}        the unit tests of the core, the drafters and the trainer (but the
#                           one that needs vLLM); on a GPU machine the trainer (accelerate, bf16
#                           autocast) and the transformers generator run on CUDA by themselves
#
# The checkout is installed without dependencies into a temporary directory (the machine
# already has them). Each step has a time limit, so that one hung step still leaves the others'
# files; the exit status is non-zero if any step failed.
set -uo pipefail
OUT="${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SITE="$(mktemp -d)"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile \
  --target "$SITE" . || exit 1
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
status=0
step() {  # step SECONDS NAME COMMAND...: run with a limit, report, remember a failure
  local limit=$1 name=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "gpu_check: $name exited $rc after $((SECONDS - start)) s" >&2
  [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >&2
# -P: the checkout's folders must not shadow the installed names (see scripts/run_tests.sh).
step 150 kernels python3 -P -m vllm_specdiff_benchmarks.kernels --device cuda \
  --dtype bfloat16 --output "$OUT/kernels_bf16.md" --json "$OUT/kernels_bf16.json"
step 200 cuda_paths python3 -P -m vllm_specdiff_benchmarks.cuda_paths --device cuda \
  --json "$OUT/cuda_paths.json"
# Tests marked `vllm` (here: the one that builds the proposer) are left out: no vLLM there.
step 200 pytest python3 -P -m pytest -q -ra -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
  -m "not vllm" tests/core tests/drafter tests/training > "$OUT/pytest.txt" 2>&1
tail -n 25 "$OUT/pytest.txt" >&2
exit "$status"
