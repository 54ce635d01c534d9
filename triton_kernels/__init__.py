"""Kernels for SpecDiff-2's self-selection path: tree-mask attention over a paged KV cache and
fused per-draft log-prob gather with streak scoring.

Installed as `vllm_specdiff_kernels` (the folder is `triton_kernels/`; the name `triton_kernels`
belongs to Triton's own package, which vLLM looks for). Import the entry points from
`vllm_specdiff_kernels.dispatch`; the backend is chosen by `vllm_specdiff.core.backends`
(Triton on CUDA, torch elsewhere). Importing this package registers its Triton kernels with the
core and never imports Triton, so it works where Triton is absent (vLLM on CPU).
"""

from .dispatch import TREE_ATTENTION_KERNEL, draft_logprob_streak, register, tree_attention
from .tree_attention_ref import tree_attention_torch
from .tree_mask import pack_bool_mask, tree_mask_from_parents, unpack_tree_mask

__all__ = [
    "TREE_ATTENTION_KERNEL",
    "draft_logprob_streak",
    "pack_bool_mask",
    "register",
    "tree_attention",
    "tree_attention_torch",
    "tree_mask_from_parents",
    "unpack_tree_mask",
]
