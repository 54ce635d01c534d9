"""Kernels for SpecDiff-2's self-selection path: tree-mask attention over a paged KV cache and
fused per-draft log-prob gather with streak scoring.

Import the entry points from `triton_kernels.dispatch` (Triton on CUDA, torch elsewhere). This
package never imports Triton at import time, so it works where Triton is absent (vLLM on CPU).
"""

from triton_kernels.dispatch import draft_logprob_streak, select_backend, tree_attention
from triton_kernels.tree_attention_ref import tree_attention_torch
from triton_kernels.tree_mask import pack_bool_mask, tree_mask_from_parents, unpack_tree_mask

__all__ = [
    "draft_logprob_streak",
    "pack_bool_mask",
    "select_backend",
    "tree_attention",
    "tree_attention_torch",
    "tree_mask_from_parents",
    "unpack_tree_mask",
]
