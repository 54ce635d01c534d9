"""Torch reference of tree-mask attention over vLLM's paged KV cache.

This is the oracle for the Triton kernel and the CPU path of the self-selecting runner (vLLM's
CPU build has no Triton). Each request's flattened tree nodes attend to the request's whole
cached prefix and, inside the tree, to themselves and their ancestors (packed bitmask, see
`tree_mask`). Scores and softmax are float32; a row that sees no key at all
(only possible with an empty prefix and a mask row without its own bit) returns zeros.

Layouts (vLLM's):
    query        [N, H, D]     tree nodes of all requests, request-major, post-RoPE
    key, value   [N, Hkv, D]   the tree nodes' own K/V; or None when the caller already wrote them
                               into the cache right after the prefix (positions prefix_len + local)
    key_cache    [num_blocks, block_size, Hkv, D]   (value_cache likewise)
    block_tables [B, max_blocks] physical block of each logical block of each request
    prefix_lens  [B]           cached prefix tokens per request (the tree is not counted)
    cu_seqlens   [B + 1]       node range of each request (`TokenTree.offsets`)
    tree_mask    [N, W] int32  packed ancestor-or-self bits over local node indices
"""

from __future__ import annotations

import math

import torch

from .tree_mask import WORD_BITS, unpack_tree_mask


def check_tree_attention_inputs(query: torch.Tensor, key: torch.Tensor | None,
                                value: torch.Tensor | None, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, block_tables: torch.Tensor,
                                prefix_lens: torch.Tensor, cu_seqlens: torch.Tensor,
                                tree_mask: torch.Tensor) -> None:
    """Shape/dtype checks shared by the torch and Triton paths (no device sync)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [N, H, D], got shape {tuple(query.shape)}")
    n, h, d = query.shape
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    h_kv = key_cache.shape[2]
    if key_cache.shape[3] != d:
        raise ValueError(f"head_dim mismatch: query {d}, key_cache {key_cache.shape[3]}")
    if h % h_kv != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({h_kv})")
    if (key is None) != (value is None):
        raise ValueError("key and value must both be given or both be None")
    if key is not None and value is not None:
        if key.shape != (n, h_kv, d) or value.shape != (n, h_kv, d):
            raise ValueError(f"key/value must be [{n}, {h_kv}, {d}], "
                             f"got {tuple(key.shape)} and {tuple(value.shape)}")
        if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
            raise ValueError("key/value dtype must match the KV cache dtype")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}")
    if key_cache.dtype != query.dtype:
        raise ValueError(f"KV cache dtype {key_cache.dtype} differs from query dtype {query.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be [B + 1] with B >= 1")
    b = cu_seqlens.shape[0] - 1
    if prefix_lens.shape != (b,):
        raise ValueError(f"prefix_lens must be [{b}], got shape {tuple(prefix_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [{b}, max_blocks], got {tuple(block_tables.shape)}")
    if tree_mask.dim() != 2 or tree_mask.shape[0] != n or tree_mask.dtype != torch.int32:
        raise ValueError(f"tree_mask must be int32 [{n}, W], got {tree_mask.dtype} "
                         f"{tuple(tree_mask.shape)}")
    for name, t in (("block_tables", block_tables), ("prefix_lens", prefix_lens),
                    ("cu_seqlens", cu_seqlens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    tensors = (query, key, value, key_cache, value_cache, block_tables, prefix_lens, cu_seqlens,
               tree_mask)
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one request from a paged cache -> [length, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table.long()[pos // block_size]
    return cache[blocks, pos % block_size]


def tree_attention_torch(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                         key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, prefix_lens: torch.Tensor,
                         cu_seqlens: torch.Tensor, tree_mask: torch.Tensor,
                         softmax_scale: float | None = None, *, max_tree_nodes: int | None = None,
                         max_prefix_len: int | None = None, num_splits: int | None = None
                         ) -> torch.Tensor:
    """Attention output [N, H, D] (query dtype) of tree nodes over prefix + ancestors.

    `max_tree_nodes`, `max_prefix_len` and `num_splits` are launch hints for the Triton path
    (kept here so both paths share one signature); the reference does not need them.
    """
    del max_tree_nodes, max_prefix_len, num_splits
    check_tree_attention_inputs(query, key, value, key_cache, value_cache, block_tables,
                                prefix_lens, cu_seqlens, tree_mask)
    n, h, d = query.shape
    h_kv = key_cache.shape[2]
    group = h // h_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros_like(query)
    offsets = cu_seqlens.tolist()
    lens = prefix_lens.tolist()
    for b, prefix in enumerate(lens):
        start, end = offsets[b], offsets[b + 1]
        nodes = end - start
        if nodes == 0:
            continue
        if nodes > tree_mask.shape[1] * WORD_BITS:
            raise ValueError(f"request {b} has {nodes} tree nodes but tree_mask has only "
                             f"{tree_mask.shape[1] * WORD_BITS} bits per row")
        cached = prefix + (nodes if key is None else 0)
        keys = _gather_paged(key_cache, block_tables[b], cached)
        values = _gather_paged(value_cache, block_tables[b], cached)
        if key is not None and value is not None:
            keys = torch.cat([keys, key[start:end]], dim=0)
            values = torch.cat([values, value[start:end]], dim=0)
        visible = torch.cat([
            torch.ones(nodes, prefix, dtype=torch.bool, device=query.device),
            unpack_tree_mask(tree_mask[start:end], nodes),
        ], dim=1)  # [nodes, prefix + nodes]
        # Query head h uses KV head h // group: view the heads as [Hkv, group] instead of
        # repeating K/V.
        q = query[start:end].float().view(nodes, h_kv, group, d)
        k = keys.float()  # [L, Hkv, D]
        v = values.float()
        scores = torch.einsum("nkgd,lkd->kgnl", q, k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        probs = torch.exp(scores - row_max)  # masked entries -> exp(-inf) = 0
        denom = probs.sum(dim=-1, keepdim=True)
        weights = probs / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[start:end] = torch.einsum("kgnl,lkd->nkgd", weights, v).reshape(nodes, h, d).to(
            query.dtype)
    return out
