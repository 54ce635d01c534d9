"""One entry point per kernel, routed by the core's backend choice (`vllm_specdiff.core.backends`).

The core owns the choice (SPECDIFF_KERNELS=auto|torch|triton) and the scoring kernel's torch
reference; this package only registers its Triton implementations with it (`register`, run on
import and through the `vllm_specdiff.kernels` entry point), so the core never imports this
package. Nothing here imports Triton until a Triton path is actually chosen: vLLM's CPU build
ships without it.
"""

from __future__ import annotations

import torch

from vllm_specdiff.core import backends
from vllm_specdiff.core.backends import Kernel
from vllm_specdiff.core.scoring import STREAK_KERNEL, draft_logprob_streak_torch

from .tree_attention_ref import tree_attention_torch

TREE_ATTENTION_KERNEL = "tree_attention"


def _tree_attention_triton() -> Kernel:
    from .tree_attention_triton import tree_attention_triton

    return tree_attention_triton


def _draft_logprob_streak_triton() -> Kernel:
    from .draft_logprobs_triton import draft_logprob_streak_triton

    return draft_logprob_streak_triton


def register() -> None:
    """Register both Triton kernels with the core (idempotent; the entry point calls it)."""
    backends.register_triton(TREE_ATTENTION_KERNEL, _tree_attention_triton)
    backends.register_triton(STREAK_KERNEL, _draft_logprob_streak_triton)


register()


def tree_attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                   key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_tables: torch.Tensor, prefix_lens: torch.Tensor,
                   cu_seqlens: torch.Tensor, tree_mask: torch.Tensor,
                   softmax_scale: float | None = None, *, max_tree_nodes: int | None = None,
                   max_prefix_len: int | None = None, num_splits: int | None = None
                   ) -> torch.Tensor:
    """Tree-mask attention [N, H, D] over a paged prefix; see `tree_attention_ref` for layouts."""
    impl = backends.implementation(TREE_ATTENTION_KERNEL, query.device, tree_attention_torch)
    return impl(query, key, value, key_cache, value_cache, block_tables, prefix_lens, cu_seqlens,
                tree_mask, softmax_scale, max_tree_nodes=max_tree_nodes,
                max_prefix_len=max_prefix_len, num_splits=num_splits)


def draft_logprob_streak(node_logits: torch.Tensor, node_temperature: torch.Tensor,
                         node_tokens: torch.Tensor, parents: torch.Tensor,
                         draft_nodes: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_a [B,K,G], tau [B,K], selected [B]); same contract as the core's torch reference."""
    impl = backends.implementation(STREAK_KERNEL, node_logits.device, draft_logprob_streak_torch)
    return impl(node_logits, node_temperature, node_tokens, parents, draft_nodes)
