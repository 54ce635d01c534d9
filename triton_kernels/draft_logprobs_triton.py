"""Triton: per-draft log-probs and expected streaks from the verifier's tree logits.

Same contract as `vllm_specdiff.core.scoring.draft_logprob_streak_torch`:
log a for node i = log_softmax(node_logits[parents[i]] / T)[node_tokens[i]] with T the
temperature of the parent row; T == 0 is greedy (0 if the token is the row's argmax, lowest index
on ties, else -inf). tau_k = sum_j exp(cumsum_j log a_kj); selected = argmax_k tau_k (ties:
lowest k).

Why fused: the unfused version materialises a [N, V] log-softmax (V up to 256k) just to read one
entry per row. Here stage 1 makes ONE pass over each scored node's parent row, keeping an online
max / sum-exp and the running argmax (never the softmax); the row may be split over several
programs so that small trees still fill the GPU. Stage 2, one tiny program per request, merges
the split statistics, gathers the token's logit, and does cumsum/exp/sum per draft and the
argmax over drafts. `-inf` entries (top-k/top-p) contribute nothing; a -inf token gives -inf.
"""

# Triton reads kernel parameter annotations as type/specialisation specs, so pointer and
# scalar arguments of @triton.jit functions stay unannotated.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import multiprocessor_count


@triton.jit
def _row_stats_kernel(logits_ptr, temp_ptr, parents_ptr, m_ptr, l_ptr, best_val_ptr,
                      best_idx_ptr, stride_row, vocab, num_splits, BLOCK_V: tl.constexpr):
    """Partial (max, sum-exp) of row/T and (max, argmax) of the raw row over one vocab chunk."""
    node = tl.program_id(0)
    split = tl.program_id(1)
    parent = tl.load(parents_ptr + node).to(tl.int64)
    if parent < 0:
        return  # a root: nothing to score
    temp = tl.load(temp_ptr + parent).to(tl.float32)
    temp = tl.where(temp > 0.0, temp, 1.0)  # greedy rows only need the argmax
    chunk = tl.cdiv(tl.cdiv(vocab, num_splits), BLOCK_V) * BLOCK_V
    lo = split * chunk
    hi = tl.minimum(vocab, lo + chunk)
    row = logits_ptr + parent * stride_row
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = lo
    for start in range(lo, hi, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        xs = x / temp
        m_new = tl.maximum(m, tl.max(xs, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(xs - shift), axis=0)
        m = m_new
        block_best = tl.max(x, axis=0)
        block_idx = start + tl.argmax(x, axis=0, tie_break_left=True)
        better = block_best > best_val  # strict: earlier index wins ties
        best_idx = tl.where(better, block_idx, best_idx)
        best_val = tl.where(better, block_best, best_val)
    out = node * num_splits + split
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, total)
    tl.store(best_val_ptr + out, best_val)
    tl.store(best_idx_ptr + out, best_idx)


@triton.jit
def _streak_kernel(logits_ptr, temp_ptr, tokens_ptr, parents_ptr, draft_nodes_ptr, m_ptr, l_ptr,
                   best_val_ptr, best_idx_ptr, log_a_ptr, tau_ptr, selected_ptr, stride_row,
                   num_drafts, gamma, num_splits, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """One request: merge split stats, log a per (draft, position), tau per draft, argmax."""
    req = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_G)
    k_ok = offs_k < num_drafts
    valid = k_ok[:, None] & (offs_g < gamma)[None, :]
    idx = (req * num_drafts + offs_k[:, None]) * gamma + offs_g[None, :]
    node = tl.load(draft_nodes_ptr + idx, mask=valid, other=0).to(tl.int64)

    m = tl.full([BLOCK_K, BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_K, BLOCK_G], tl.float32)
    best_val = tl.full([BLOCK_K, BLOCK_G], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_K, BLOCK_G], tl.int32)
    # Splits in vocab order; a strict > keeps the lowest index on ties (split 0 starts at 0, so
    # an all -inf row reports index 0 like torch.argmax).
    for s in range(num_splits):
        part = node * num_splits + s
        m_s = tl.load(m_ptr + part, mask=valid, other=float("-inf"))
        l_s = tl.load(l_ptr + part, mask=valid, other=0.0)
        bv_s = tl.load(best_val_ptr + part, mask=valid, other=float("-inf"))
        bi_s = tl.load(best_idx_ptr + part, mask=valid, other=0)
        m_new = tl.maximum(m, m_s)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - shift) + l_s * tl.exp(m_s - shift)
        m = m_new
        better = bv_s > best_val
        best_idx = tl.where(better, bi_s, best_idx)
        best_val = tl.where(better, bv_s, best_val)

    parent = tl.load(parents_ptr + node, mask=valid, other=-1).to(tl.int64)
    scored = valid & (parent >= 0)
    token = tl.load(tokens_ptr + node, mask=scored, other=0).to(tl.int64)
    temp = tl.load(temp_ptr + parent, mask=scored, other=1.0).to(tl.float32)
    x_tok = tl.load(logits_ptr + parent * stride_row + token, mask=scored,
                    other=float("-inf")).to(tl.float32)
    greedy = temp <= 0.0
    # total == 0 only when the whole row is -inf, and then so is the token: log a = -inf.
    lse = tl.where(total > 0.0, m + tl.log(tl.where(total > 0.0, total, 1.0)), 0.0)
    sampled = tl.where(x_tok == float("-inf"), float("-inf"),
                       x_tok / tl.where(greedy, 1.0, temp) - lse)
    argmax_hit = tl.where(best_idx.to(tl.int64) == token, 0.0, float("-inf"))
    log_a = tl.where(greedy, argmax_hit, sampled)
    log_a = tl.where(scored, log_a, 0.0)
    tl.store(log_a_ptr + idx, log_a, mask=valid)

    streak = tl.exp(tl.cumsum(log_a, axis=1))
    tau = tl.sum(tl.where(valid, streak, 0.0), axis=1)
    tl.store(tau_ptr + req * num_drafts + offs_k, tau, mask=k_ok)
    best = tl.argmax(tl.where(k_ok, tau, -1.0), axis=0, tie_break_left=True)
    tl.store(selected_ptr + req, best.to(tl.int64))


def check_streak_inputs(node_logits: torch.Tensor, node_temperature: torch.Tensor,
                        node_tokens: torch.Tensor, parents: torch.Tensor,
                        draft_nodes: torch.Tensor) -> None:
    """Shape/dtype checks (no device sync)."""
    if node_logits.dim() != 2 or not node_logits.is_floating_point():
        raise ValueError(f"node_logits must be a float [N, V] tensor, got {node_logits.dtype} "
                         f"{tuple(node_logits.shape)}")
    n = node_logits.shape[0]
    for name, t in (("node_temperature", node_temperature), ("node_tokens", node_tokens),
                    ("parents", parents)):
        if t.shape != (n,):
            raise ValueError(f"{name} must be [{n}], got shape {tuple(t.shape)}")
    if draft_nodes.dim() != 3:
        raise ValueError(f"draft_nodes must be [B, K, G], got shape {tuple(draft_nodes.shape)}")
    for name, t in (("node_tokens", node_tokens), ("parents", parents),
                    ("draft_nodes", draft_nodes)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    devices = {t.device for t in (node_logits, node_temperature, node_tokens, parents,
                                  draft_nodes)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def _default_num_splits(num_nodes: int, vocab: int, block_v: int, device: torch.device) -> int:
    """Split rows so that about 4 programs per SM stream the vocabulary."""
    if device.type != "cuda":
        return 1
    sms = multiprocessor_count(device)
    want = -(-4 * sms // max(num_nodes, 1))
    return int(max(1, min(want, -(-vocab // block_v), 32)))


def draft_logprob_streak_triton(node_logits: torch.Tensor, node_temperature: torch.Tensor,
                                node_tokens: torch.Tensor, parents: torch.Tensor,
                                draft_nodes: torch.Tensor, *, block_v: int | None = None,
                                num_splits: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_a [B,K,G] float32, tau [B,K] float32, selected [B] int64), fused in Triton.

    `block_v` (vocab tile, power of two) and `num_splits` (programs per row) are tuning knobs;
    the defaults suit the GPU.
    """
    check_streak_inputs(node_logits, node_temperature, node_tokens, parents, draft_nodes)
    n, vocab = node_logits.shape
    b, k, g = draft_nodes.shape
    device = node_logits.device
    if node_logits.stride(1) != 1:
        node_logits = node_logits.contiguous()
    node_temperature = node_temperature.contiguous()
    node_tokens = node_tokens.contiguous()
    parents = parents.contiguous()
    draft_nodes = draft_nodes.contiguous()
    if block_v is None:
        block_v = min(4096, triton.next_power_of_2(max(vocab, 16)))
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if num_splits is None:
        num_splits = _default_num_splits(n, vocab, block_v, device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    log_a = torch.empty(b, k, g, dtype=torch.float32, device=device)
    tau = torch.empty(b, k, dtype=torch.float32, device=device)
    selected = torch.empty(b, dtype=torch.int64, device=device)
    if b == 0 or k == 0 or g == 0:
        return log_a, tau.zero_(), selected.zero_()
    stats = torch.empty(3, n, num_splits, dtype=torch.float32, device=device)
    best_idx = torch.empty(n, num_splits, dtype=torch.int32, device=device)
    if n > 0:
        _row_stats_kernel[(n, num_splits)](
            node_logits, node_temperature, parents, stats[0], stats[1], stats[2], best_idx,
            node_logits.stride(0), vocab, num_splits, BLOCK_V=block_v,
            num_warps=8 if block_v >= 2048 else 4)
    _streak_kernel[(b,)](
        node_logits, node_temperature, node_tokens, parents, draft_nodes, stats[0], stats[1],
        stats[2], best_idx, log_a, tau, selected, node_logits.stride(0), k, g, num_splits,
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        BLOCK_G=max(2, triton.next_power_of_2(g)))
    return log_a, tau, selected
