"""Tree-masked attention for vLLM's CUDA attention backends, and moving committed KV entries.

vLLM 0.32's FlashAttention (`FlashAttentionImpl`) and Triton attention (`TritonAttentionImpl`)
backends give each layer one cache tensor of logical shape
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`: K of a (block, head, token) in
`[..., :head_size]`, V in `[..., head_size:]`. Its physical strides follow the KV cache layout
vLLM resolved (`vllm.v1.kv_cache_layout.KVCacheLayout`: heads-major LBHNC, tokens-major LBNHC,
block-major variants); the channel axis is always innermost. Both backends read it as
`kv_cache.transpose(1, 2).split(head_size, dim=-1)`: K and V views
`[num_blocks, block_size, num_kv_heads, head_size]`, exactly what the project's tree-attention
kernel (`vllm_specdiff_kernels.dispatch.tree_attention`) takes, strides and all, so nothing is
copied or gathered on the host.

The wrapper lets the native kernel run the batch (it also writes every token's K/V through the
slot mapping), then recomputes the trie requests' rows in one kernel call over all of them:
Triton on CUDA tensors, the torch reference otherwise (`SPECDIFF_KERNELS`). This module imports
neither vLLM nor Triton at import time (the GPU check script runs it without vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from vllm_specdiff.plugin.tree_attention import (
    TreeBatchContext,
    TreeForward,
    TreeRequest,
    wrap_attention_layers,
)

CUDA_BACKENDS = "vLLM's FlashAttention or Triton attention backend " \
    "(--attention-backend FLASH_ATTN or TRITON_ATTN)"


@dataclass(frozen=True)
class PagedKVLayout:
    """The CUDA backends' cache layout (see the module docstring); slots are
    block * block_size + offset, as in vLLM's slot mapping."""

    block_size: int
    head_dim: int

    @classmethod
    def for_cache(cls, kv_cache: torch.Tensor, head_dim: int) -> PagedKVLayout:
        """The layout of one layer's cache tensor, checked against the head size."""
        if kv_cache.dim() != 4 or kv_cache.shape[3] != 2 * head_dim:
            raise ValueError("tree verification (K > 1) expects the CUDA backends' KV cache "
                             "[num_blocks, num_kv_heads, block_size, 2 * head_size] with "
                             f"head_size {head_dim}, got {tuple(kv_cache.shape)}")
        if kv_cache.stride(3) != 1:
            raise ValueError("tree verification (K > 1) needs the KV cache's channel axis "
                             f"innermost, got strides {kv_cache.stride()}")
        return cls(int(kv_cache.shape[2]), head_dim)

    def split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches as [num_blocks, block_size, kv_heads, head_dim] views."""
        paged = kv_cache.transpose(1, 2)
        return paged[..., :self.head_dim], paged[..., self.head_dim:]

    def _locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.long()
        return slots // self.block_size, slots % self.block_size

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [len(slots), kv_heads, head_dim] stored at the given slots (copies)."""
        key_cache, value_cache = self.split(kv_cache)
        blocks, offsets = self._locate(slots)
        return key_cache[blocks, offsets], value_cache[blocks, offsets]

    def move(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V entries at slots src to slots dst (all sources read before writing)."""
        keys, values = self.gather(kv_cache, src)
        key_cache, value_cache = self.split(kv_cache)
        blocks, offsets = self._locate(dst)
        key_cache[blocks, offsets] = keys
        value_cache[blocks, offsets] = values


@dataclass(frozen=True)
class PackedTreeBatch:
    """All trie requests of one forward as the tree-attention kernel's inputs (built once per
    forward, shared by the layers). rows [N]: the nodes' query rows, request after request."""

    rows: torch.Tensor
    batch_indices: torch.Tensor
    prefix_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    tree_mask: torch.Tensor
    max_tree_nodes: int
    max_prefix_len: int


def pack_tree_batch(requests: list[TreeRequest], device: torch.device) -> PackedTreeBatch:
    """Pack the requests' rows, prefixes and ancestor masks (packed bits, one width)."""
    from vllm_specdiff_kernels.tree_mask import num_mask_words, pack_bool_mask

    max_nodes = max(req.num_nodes for req in requests)
    words = num_mask_words(max_nodes)
    masks = []
    for req in requests:
        packed = pack_bool_mask(req.mask.cpu())
        masks.append(F.pad(packed, (0, words - packed.shape[1])))
    counts = torch.tensor([req.num_nodes for req in requests], dtype=torch.int32)
    cu_seqlens = torch.zeros(len(requests) + 1, dtype=torch.int32)
    cu_seqlens[1:] = counts.cumsum(0)
    rows = torch.cat([torch.arange(req.query_start, req.query_start + req.num_nodes)
                      for req in requests])
    return PackedTreeBatch(
        rows=rows.to(device),
        batch_indices=torch.tensor([req.batch_index for req in requests]).to(device),
        prefix_lens=torch.tensor([req.prefix_len for req in requests],
                                 dtype=torch.int32).to(device),
        cu_seqlens=cu_seqlens.to(device),
        tree_mask=torch.cat(masks).to(device),
        max_tree_nodes=max_nodes,
        max_prefix_len=max(req.prefix_len for req in requests),
    )


class CudaTreeMaskForward(TreeForward):
    """CUDA: one tree-attention kernel call over all trie requests, reading the prefix straight
    from the paged cache through the requests' block tables."""

    def recompute(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor
                  ) -> None:
        from vllm_specdiff_kernels.dispatch import tree_attention

        batch = self.context.memo(
            "cuda", lambda: pack_tree_batch(self.context.requests, query.device))
        key_cache, value_cache = self.layout.split(kv_cache)
        block_tables = attn_metadata.block_table.index_select(0, batch.batch_indices)
        out = tree_attention(query.index_select(0, batch.rows),
                             key.index_select(0, batch.rows), value.index_select(0, batch.rows),
                             key_cache, value_cache, block_tables, batch.prefix_lens,
                             batch.cu_seqlens, batch.tree_mask, self.scale,
                             max_tree_nodes=batch.max_tree_nodes,
                             max_prefix_len=batch.max_prefix_len)
        output.index_copy_(0, batch.rows, out.to(output.dtype))


def cuda_attention_impls() -> tuple[type, ...]:
    """vLLM's CUDA attention implementations whose cache layout `PagedKVLayout` reads."""
    impls: list[type] = []
    try:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

        impls.append(FlashAttentionImpl)
    except ImportError:
        pass
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    impls.append(TritonAttentionImpl)
    return tuple(impls)


def _layout_for(layer: Any, kv_cache: torch.Tensor) -> PagedKVLayout:
    return PagedKVLayout.for_cache(kv_cache, int(layer.impl.head_size))


def install_cuda_tree_attention(attention_layers: dict[str, Any], context: TreeBatchContext,
                                impl_types: tuple[type, ...] | None = None) -> PagedKVLayout:
    """Wrap the forward of every CUDA attention layer; returns the cache layout.

    impl_types defaults to `cuda_attention_impls()`.
    """
    return wrap_attention_layers(attention_layers, impl_types or cuda_attention_impls(),
                                 CUDA_BACKENDS, _layout_for,
                                 lambda impl, layout: CudaTreeMaskForward(impl, layout, context))
