"""Engine-agnostic SpecDiff-2 algorithms in plain torch.

Shared by the vLLM plugin, the reference decoder, training and benchmarks; nothing here imports
vLLM or transformers. Data flows one way: drafter marginals -> drafts -> token tree -> verifier
logits at the tree nodes -> scores (tau) -> acceptance -> committed tokens. The proposer's
per-request drafting pieces sit here too: candidate drafts and prompt lookup (`candidates`), the
datastore's retrieved drafts (`datastore`) and a request's chain-first trie (`trie`).
"""

from vllm_specdiff.core.acceptance import (
    Verdict,
    path_probs,
    verify_greedy,
    verify_point_mass,
    verify_standard,
    verify_tree,
)
from vllm_specdiff.core.metrics import SpecDecodeStats
from vllm_specdiff.core.sampling import draft_marginals, filter_logits, sample_drafts, target_probs
from vllm_specdiff.core.scoring import (
    DraftScores,
    draft_logprob_streak_torch,
    expected_streak,
    score_drafts,
)
from vllm_specdiff.core.tree import TokenTree, build_token_tree

# gamma, draft tokens per step: the one default of the plugin, the CLIs, training and evaluation
DEFAULT_GAMMA = 8

__all__ = [
    "DEFAULT_GAMMA",
    "DraftScores",
    "SpecDecodeStats",
    "TokenTree",
    "Verdict",
    "build_token_tree",
    "draft_logprob_streak_torch",
    "draft_marginals",
    "expected_streak",
    "filter_logits",
    "path_probs",
    "sample_drafts",
    "score_drafts",
    "target_probs",
    "verify_greedy",
    "verify_point_mass",
    "verify_standard",
    "verify_tree",
]
