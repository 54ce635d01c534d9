"""The packed ancestor-or-self bitmask that tree attention reads.

Why a bitmask and not the parent array: a kernel tile needs "may query node a see key node b"
for a whole [rows x cols] block at once; with bits that is one gathered int32 load and a shift,
whereas a parent array needs a pointer walk per pair. The mask costs ceil(n/32) words per node.

Layout: `tree_mask[i, w]` (int32) is row i = global tree node i; bit `t` of word `w` is set iff
the node with LOCAL index `32 * w + t` of the same request (0 = that request's first node) is i
itself or one of its ancestors. Bits beyond a request's node count must be 0.
"""

from __future__ import annotations

import torch

WORD_BITS = 32


def num_mask_words(max_nodes: int) -> int:
    """int32 words per row needed for requests of up to `max_nodes` tree nodes."""
    return max(1, -(-max_nodes // WORD_BITS))


def pack_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """[N, M] bool (column = local key index) -> [N, ceil(M/32)] int32 packed bits."""
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a 2-D bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    n, m = mask.shape
    words = num_mask_words(m)
    padded = torch.zeros(n, words * WORD_BITS, dtype=torch.int64, device=mask.device)
    padded[:, :m] = mask.to(torch.int64)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=mask.device) << torch.arange(
        WORD_BITS, device=mask.device)
    packed = (padded.view(n, words, WORD_BITS) * weights).sum(dim=-1)
    # Reinterpret as two's-complement int32 (bit 31 set -> negative).
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_tree_mask(tree_mask: torch.Tensor, num_cols: int) -> torch.Tensor:
    """[N, W] int32 packed bits -> [N, num_cols] bool (inverse of `pack_bool_mask`)."""
    cols = torch.arange(num_cols, device=tree_mask.device)
    words = tree_mask.to(torch.int64)[:, cols // WORD_BITS]
    return ((words >> (cols % WORD_BITS)) & 1).bool()


def tree_mask_from_parents(parents: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_nodes: int | None = None) -> torch.Tensor:
    """Packed ancestor-or-self mask [N, ceil(max_nodes/32)] int32 from a parent array.

    parents:    [N] global index of each node's parent, -1 for roots (parents of a request's
                nodes must lie in the same request).
    cu_seqlens: [B + 1] node range of each request (`TokenTree.offsets`).
    """
    if parents.dim() != 1 or cu_seqlens.dim() != 1:
        raise ValueError("parents must be [N] and cu_seqlens [B + 1]")
    device = parents.device
    n = parents.shape[0]
    counts = cu_seqlens[1:] - cu_seqlens[:-1]
    if max_nodes is None:
        max_nodes = int(counts.max()) if counts.numel() else 0
    req = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts)
    if req.shape[0] != n:
        raise ValueError(f"cu_seqlens covers {req.shape[0]} nodes but parents has {n}")
    start = cu_seqlens.to(device)[req]
    parents = parents.long()
    bits = torch.zeros(n, max(max_nodes, 1), dtype=torch.bool, device=device)
    rows = torch.arange(n, device=device)
    current = rows.clone()
    alive = torch.ones(n, dtype=torch.bool, device=device)
    # Depth <= max_nodes - 1, so max_nodes steps reach every root; stop early once all have.
    for _ in range(max(max_nodes, 1)):
        local = current - start
        if bool(((local < 0) | (local >= bits.shape[1]))[alive].any()):
            raise ValueError("parents must point to nodes of the same request (see cu_seqlens)")
        bits[rows[alive], local[alive]] = True
        parent = parents[current]
        alive = alive & (parent >= 0)
        if not bool(alive.any()):
            break
        current = torch.where(alive, parent, current)
    return pack_bool_mask(bits)
