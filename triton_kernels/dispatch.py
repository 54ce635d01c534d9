"""One entry point per kernel: Triton on CUDA, the torch reference elsewhere.

vLLM's CPU build ships without Triton, so nothing here imports Triton until a Triton path is
actually chosen. `SPECDIFF_KERNELS` overrides the choice:
    auto   (default) Triton when the tensors are on CUDA and Triton imports, else torch;
    torch  always the torch reference;
    triton always Triton; on CPU tensors this needs TRITON_INTERPRET=1 (the interpreter, which
           is how the tests check the kernels without a GPU).
"""

from __future__ import annotations

import functools
import os

import torch

ENV_VAR = "SPECDIFF_KERNELS"
BACKENDS = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (it is absent from vLLM's CPU build)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def select_backend(device: torch.device) -> str:
    """'triton' or 'torch' for tensors on `device`, honouring SPECDIFF_KERNELS."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise ValueError(f"{ENV_VAR}=triton but Triton is not installed")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(f"{ENV_VAR}=triton with {device.type} tensors needs "
                             "TRITON_INTERPRET=1 (Triton compiles for GPUs only)")
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def tree_attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                   key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_tables: torch.Tensor, prefix_lens: torch.Tensor,
                   cu_seqlens: torch.Tensor, tree_mask: torch.Tensor,
                   softmax_scale: float | None = None, *, max_tree_nodes: int | None = None,
                   max_prefix_len: int | None = None, num_splits: int | None = None
                   ) -> torch.Tensor:
    """Tree-mask attention [N, H, D] over a paged prefix; see `tree_attention_ref` for layouts."""
    if select_backend(query.device) == "triton":
        from triton_kernels.tree_attention_triton import tree_attention_triton as impl
    else:
        from triton_kernels.tree_attention_ref import tree_attention_torch as impl
    return impl(query, key, value, key_cache, value_cache, block_tables, prefix_lens, cu_seqlens,
                tree_mask, softmax_scale, max_tree_nodes=max_tree_nodes,
                max_prefix_len=max_prefix_len, num_splits=num_splits)


def draft_logprob_streak(node_logits: torch.Tensor, node_temperature: torch.Tensor,
                         node_tokens: torch.Tensor, parents: torch.Tensor,
                         draft_nodes: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_a [B,K,G], tau [B,K], selected [B]); same contract as the core's torch reference."""
    if select_backend(node_logits.device) == "triton":
        from triton_kernels.draft_logprobs_triton import draft_logprob_streak_triton as impl
    else:
        from vllm_specdiff.core.scoring import draft_logprob_streak_torch as impl
    return impl(node_logits, node_temperature, node_tokens, parents, draft_nodes)
