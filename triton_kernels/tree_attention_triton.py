"""Triton tree-mask attention over vLLM's paged KV cache (forward only).

Same contract as `tree_attention_ref.tree_attention_torch` (layouts documented there). One
program handles a tile of (tree node, query head) rows of one request that share a KV head, so
grouped-query heads load each K/V tile once. It streams the paged prefix (gathering through the
block table token by token, so any block size works), then the tree nodes' own K/V under the
packed ancestor-or-self bitmask, with an online softmax in float32 (exp2 domain).

Long prefixes with few programs leave the GPU idle, so the prefix can be split over
`num_splits` programs per tile (flash-decoding); each writes a partial output and its
log-sum-exp, and a small kernel merges them. Rows that see no key produce zeros, not NaN.
"""

# Triton reads kernel parameter annotations as type/specialisation specs, so pointer and
# scalar arguments of @triton.jit functions stay unannotated.
# ruff: noqa: ANN001

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import multiprocessor_count
from .tree_attention_ref import check_tree_attention_inputs
from .tree_mask import WORD_BITS

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b with float32 accumulation; UPCAST_DOT computes in float32 (interpreter only:
    Triton 3.6's interpreter gets bfloat16 dots wrong)."""
    if UPCAST_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _online_update(qk, m_i, l_i, acc, v, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step; qk already scaled to log2 units with -inf where masked."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # A row with nothing visible so far keeps m = -inf; use 0 as the shift to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, prefix_lens_ptr,
    cu_seqlens_ptr, mask_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,
    stride_qn, stride_qh,
    stride_kn, stride_kh,
    stride_vn, stride_vh,
    stride_cb, stride_ct, stride_ch,
    stride_vcb, stride_vct, stride_vch,
    stride_bt,
    stride_mask,
    stride_on, stride_oh,
    num_nodes_total, num_heads, num_splits,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, TREE_KV_IN_CACHE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    req = tl.program_id(1) // (num_heads // GROUP)
    kv_head = tl.program_id(1) % (num_heads // GROUP)
    split = tl.program_id(2)

    node_start = tl.load(cu_seqlens_ptr + req).to(tl.int32)
    num_nodes = tl.load(cu_seqlens_ptr + req + 1).to(tl.int32) - node_start
    if tile * BLOCK_M >= num_nodes * GROUP:
        return
    prefix_len = tl.load(prefix_lens_ptr + req).to(tl.int32)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    node = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = node < num_nodes
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    gnode = (node_start + node).to(tl.int64)
    q = tl.load(q_ptr + gnode[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # --- the cached prefix, this split's share of it (whole blocks of BLOCK_N tokens) ---
    chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(prefix_len, lo + chunk)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        tok = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + phys[:, None] * stride_cb + tok[:, None] * stride_ct
                    + kv_head * stride_ch + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + phys[:, None] * stride_vcb + tok[:, None] * stride_vct
                    + kv_head * stride_vch + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = _dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION) * qk_scale
        qk = tl.where(pos_ok[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_update(qk, m_i, l_i, acc, v, UPCAST_DOT, DOT_PRECISION)

    # --- the tree nodes themselves, under the ancestor-or-self bitmask (last split only) ---
    if split == num_splits - 1:
        mask_rows = mask_ptr + gnode * stride_mask
        for start in range(0, num_nodes, BLOCK_N):
            col = start + tl.arange(0, BLOCK_N)
            col_ok = col < num_nodes
            kv_mask = col_ok[:, None] & d_ok[None, :]
            if TREE_KV_IN_CACHE:
                pos = prefix_len + col
                phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
                tok = (pos % BLOCK_SIZE).to(tl.int64)
                k = tl.load(k_cache_ptr + phys[:, None] * stride_cb + tok[:, None] * stride_ct
                            + kv_head * stride_ch + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + phys[:, None] * stride_vcb + tok[:, None] * stride_vct
                            + kv_head * stride_vch + offs_d[None, :], mask=kv_mask, other=0.0)
            else:
                kn = (node_start + col).to(tl.int64)
                k = tl.load(k_ptr + kn[:, None] * stride_kn + kv_head * stride_kh
                            + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_ptr + kn[:, None] * stride_vn + kv_head * stride_vh
                            + offs_d[None, :], mask=kv_mask, other=0.0)
            words = tl.load(mask_rows[:, None] + (col // 32)[None, :],
                            mask=row_ok[:, None] & col_ok[None, :], other=0)
            visible = ((words >> (col % 32)[None, :]) & 1) != 0
            qk = _dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION) * qk_scale
            qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = _online_update(qk, m_i, l_i, acc, v, UPCAST_DOT, DOT_PRECISION)

    has_mass = l_i > 0.0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        tl.store(out_ptr + gnode[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partial results, float32, laid out [num_splits, N, H, D] / [num_splits, N, H].
        part_row = (split * num_nodes_total + gnode) * num_heads + head
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(has_mass, m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_on, stride_oh,
                         num_nodes_total, num_heads, num_splits,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[n, h] = sum_s w_s * part_out[s, n, h] with w_s proportional to 2^lse_s."""
    gnode = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    part_row = (offs_s * num_nodes_total + gnode) * num_heads + head
    lse = tl.load(part_lse_ptr + part_row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_shift)
    total = tl.sum(w, axis=0)
    parts = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + gnode * stride_on + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _default_num_splits(tiles: int, max_prefix_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice, each with at least 256 prefix tokens."""
    if device.type != "cuda":
        return 1
    sms = multiprocessor_count(device)
    want = -(-2 * sms // max(tiles, 1))
    return int(max(1, min(want, max_prefix_len // 256, 64)))


def tree_attention_triton(query: torch.Tensor, key: torch.Tensor | None,
                          value: torch.Tensor | None, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, block_tables: torch.Tensor,
                          prefix_lens: torch.Tensor, cu_seqlens: torch.Tensor,
                          tree_mask: torch.Tensor, softmax_scale: float | None = None, *,
                          max_tree_nodes: int | None = None, max_prefix_len: int | None = None,
                          num_splits: int | None = None) -> torch.Tensor:
    """Triton tree attention; see `tree_attention_torch` for the contract.

    Pass `max_tree_nodes` / `max_prefix_len` (host ints, e.g. from vLLM's metadata) to avoid a
    device sync; `num_splits` overrides the prefix split (1 = no split).
    """
    check_tree_attention_inputs(query, key, value, key_cache, value_cache, block_tables,
                                prefix_lens, cu_seqlens, tree_mask)
    n, h, d = query.shape
    h_kv = key_cache.shape[2]
    group = h // h_kv
    num_requests = cu_seqlens.shape[0] - 1
    if max_tree_nodes is None:
        max_tree_nodes = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if max_tree_nodes > tree_mask.shape[1] * WORD_BITS:
        raise ValueError(f"max_tree_nodes={max_tree_nodes} exceeds the {tree_mask.shape[1]} "
                         "int32 words per tree_mask row")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty_like(query)
    if n == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(16, min(64, triton.next_power_of_2(max_tree_nodes * group)))
    block_n = 64 if block_d <= 64 else 32
    tiles = -(-max_tree_nodes * group // block_m)
    if num_splits is None:
        if max_prefix_len is None:
            max_prefix_len = int(prefix_lens.max())
        num_splits = _default_num_splits(tiles * num_requests * h_kv, max_prefix_len, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits > 1:
        part_out = torch.empty(num_splits, n, h, d, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_splits, n, h, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    tree_mask = tree_mask.contiguous()
    block_tables = block_tables.contiguous()
    tree_in_cache = key is None
    k_src = key_cache if key is None else key
    v_src = value_cache if value is None else value
    if query.stride(2) != 1 or k_src.stride(-1) != 1 or v_src.stride(-1) != 1 \
            or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query/key/value/caches must be contiguous in head_dim")
    grid = (tiles, num_requests * h_kv, num_splits)
    _tree_attention_kernel[grid](
        query, k_src, v_src, key_cache, value_cache, block_tables, prefix_lens, cu_seqlens,
        tree_mask, out, part_out, part_lse,
        scale * _LOG2E,
        query.stride(0), query.stride(1),
        k_src.stride(0), k_src.stride(1),
        v_src.stride(0), v_src.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        tree_mask.stride(0),
        out.stride(0), out.stride(1),
        n, h, num_splits,
        BLOCK_SIZE=key_cache.shape[1], GROUP=group, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=num_splits > 1,
        TREE_KV_IN_CACHE=tree_in_cache, UPCAST_DOT=query.device.type != "cuda",
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_stages=2 if query.dtype == torch.float32 else 3,  # fp32 tiles: bound shared memory
    )
    if num_splits > 1:
        _merge_splits_kernel[(n, h)](
            part_out, part_lse, out, out.stride(0), out.stride(1), n, h, num_splits,
            HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        )
    return out
