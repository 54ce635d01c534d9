#!/usr/bin/env bash
# Batch 1, T = 0 on the host of 2026-12-02 17:30 UTC, whose plain verifier step measured ~67 ms
# per token (against ~36 ms on the host of the earlier results): the default (specdiff2), the
# drafter alone at fixed gamma 8 (issue 9's acceptance figure), vLLM ngram, plain decoding.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
"$ROOT/.venv/bin/vllm-specdiff" bench --prompts humaneval "$ROOT/benchmarks/prompts/chat_heldout.jsonl" \
  --limit 8 --max-tokens 96 --gamma 8 --repeats 1 --temperature 0 --batch-size 1 \
  --methods plain,ngram,specdiff2,specdiff2-nolookup:adaptive=false \
  --json "$(dirname "${BASH_SOURCE[0]}")/b1_t0.json"
