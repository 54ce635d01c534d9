"""vLLM general plugin (`vllm.general_plugins` entry point), loaded in every vLLM process.

Tree verification sends a trie of up to `max_tree_tokens - 1` nodes as a request's draft, more
than `num_speculative_tokens`. vLLM's scheduler counts every scheduled draft token in its
spec-decode statistics (and indexes a per-position list of `num_speculative_tokens` entries with
them). Only one candidate's gamma tokens are ever committed, so the count is clamped to
`num_speculative_tokens`: vLLM's `/metrics` then describe the committed path, as for K = 1.
"""

from __future__ import annotations

import logging
from typing import Any


def clamp_spec_decode_stats() -> bool:
    """Install the clamp on `SpecDecodingStats.observe_draft`; True if installed now."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    original = SpecDecodingStats.observe_draft
    if getattr(original, "specdiff_clamped", False):
        return False

    def observe_draft(self: Any, num_draft_tokens: int, num_accepted_tokens: int) -> None:  # noqa: ANN401
        original(self, min(num_draft_tokens, self.num_spec_tokens), num_accepted_tokens)

    observe_draft.specdiff_clamped = True  # type: ignore[attr-defined]
    SpecDecodingStats.observe_draft = observe_draft  # type: ignore[method-assign]
    return True


def register() -> None:
    """Entry point: vLLM calls this at start-up in the engine and worker processes."""
    clamp_spec_decode_stats()
    # vLLM's own methods (ngram, draft_model) verify through the same broken CPU kernel as
    # SpecDiff, so the fix is installed for every engine, not only when the proposer loads.
    from vllm_specdiff.plugin.cpu_fixes import fix_cpu_expand_kernel

    if fix_cpu_expand_kernel():
        logging.getLogger("vllm.specdiff").info(
            "SpecDiff: installed the fix for vLLM's CPU expand_kernel (temperature > 0 "
            "verification, every speculative method)")
    from vllm_specdiff.plugin.topk_fix import fix_cpu_top_k_only

    if fix_cpu_top_k_only():
        logging.getLogger("vllm.specdiff").info(
            "SpecDiff: installed the fix for vLLM's CPU top-k sampler on steps with no draft "
            "tokens (every speculative method)")
    from vllm_specdiff.plugin.recovered_fix import fix_recovered_tokens

    if fix_recovered_tokens():
        logging.getLogger("vllm.specdiff").info(
            "SpecDiff: vLLM's rejection sampler samples recovered tokens only where its "
            "kernel reads them (CPU; every speculative method)")
