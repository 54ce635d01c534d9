#!/usr/bin/env bash
# T = 1, batch 16, continuous batching: the default before and after recovered_fix.py sampled
# only the positions vLLM's kernel reads, two bench runs back to back (2026-12-02, training
# paused). "after" ran the working tree of that change, "before" the same tree with
# recovered_fix.py as in commit 9390ea3 (only steps without drafts skipped).
set -euo pipefail
run() { vllm-specdiff bench --prompts humaneval benchmarks/prompts/chat_heldout.jsonl --limit 32 \
  --repeats 3 --max-tokens 64 --gamma 8 --temperature 1 --batch-size 16 --batching continuous \
  --methods plain,specdiff2 --json "$1"; }
run after.json
git show 9390ea3:vllm_specdiff/plugin/recovered_fix.py > vllm_specdiff/plugin/recovered_fix.py
sed -i 's/def fix_recovered_tokens_without_drafts/def fix_recovered_tokens/' \
  vllm_specdiff/plugin/recovered_fix.py
run before.json
git checkout vllm_specdiff/plugin/recovered_fix.py
