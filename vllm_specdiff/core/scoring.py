"""Self-selection: score every draft by its expected accepted streak under the verifier.

`tau_k = sum_j prod_{i<=j} a_ki` with `a_kj = p(x_kj | s + x_k<j)`, computed as
`exp(cumsum(log a))` in float32 so long windows do not underflow. The choice depends only on `p`
and the drafts, never on acceptance coins, which is what keeps selection lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specdiff.core.backends import implementation
from vllm_specdiff.core.sampling import PerRow, Scalar, _per_row, filter_logits
from vllm_specdiff.core.tree import TokenTree

STREAK_KERNEL = "draft_logprob_streak"  # the name kernels packages register it under


@dataclass(frozen=True)
class DraftScores:
    """log_a [B, K, G], tau [B, K] and the self-selected draft index [B] (ties: lowest k)."""

    log_a: torch.Tensor
    tau: torch.Tensor
    selected: torch.Tensor


def expected_streak(log_a: torch.Tensor) -> torch.Tensor:
    """tau = sum_j exp(sum_{i<=j} log a_i) over the last dimension, in float32."""
    return log_a.float().cumsum(dim=-1).exp().sum(dim=-1)


def streak_within(log_a: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """tau [..., K] of candidates of different lengths (log_a [..., K, G] padded past each
    candidate's `lengths` [K]): the padding scores nothing."""
    positions = torch.arange(log_a.shape[-1], device=log_a.device)
    inside = positions < lengths.to(log_a.device).unsqueeze(-1)
    return expected_streak(torch.where(inside, log_a.float(), float("-inf")))


def node_logprobs_torch(node_logits: torch.Tensor, node_temperature: torch.Tensor,
                        node_tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[N] log p(token of node i | path to its parent); 0 for roots (nothing to score).

    Temperature-0 rows are greedy: 0 if the token is the parent row's argmax (lowest index on
    ties), else -inf.
    """
    scored = torch.nonzero(parents >= 0).squeeze(1)
    out = torch.zeros(node_tokens.shape[0], dtype=torch.float32, device=node_logits.device)
    if scored.numel() == 0:
        return out
    parent_rows = parents[scored]
    rows = node_logits[parent_rows].float()
    temp = node_temperature[parent_rows].float()
    greedy = temp == 0
    scale = torch.where(greedy, torch.ones_like(temp), temp)
    tokens = node_tokens[scored]
    sampled = rows.div(scale.unsqueeze(1)).log_softmax(dim=-1).gather(1, tokens.unsqueeze(1))
    is_argmax = rows.argmax(dim=-1) == tokens
    greedy_value = torch.where(is_argmax, 0.0, float("-inf"))
    out[scored] = torch.where(greedy, greedy_value, sampled.squeeze(1))
    return out


def draft_logprob_streak_torch(node_logits: torch.Tensor, node_temperature: torch.Tensor,
                               node_tokens: torch.Tensor, parents: torch.Tensor,
                               draft_nodes: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the fused scoring kernel: (log_a [B,K,G], tau [B,K], selected [B])."""
    per_node = node_logprobs_torch(node_logits, node_temperature, node_tokens, parents)
    log_a = per_node[draft_nodes]
    tau = expected_streak(log_a)
    return log_a, tau, tau.argmax(dim=-1)


def _expand_to_nodes(value: PerRow, tree: TokenTree, dtype: torch.dtype, name: str
                     ) -> torch.Tensor | None:
    if value is None:
        return None
    per_request = _per_row(value, tree.num_requests, dtype, tree.tokens.device, name)
    return per_request[tree.request_index()]


def score_drafts(node_logits: torch.Tensor, tree: TokenTree, temperature: Scalar | torch.Tensor,
                 top_k: PerRow = None, top_p: PerRow = None) -> DraftScores:
    """Score all drafts of a tree from the verifier's logits at its nodes [N, V].

    Settings are the request's own (scalar or one per request). Without top-k/top-p the raw
    logits go straight to the fused kernel (a registered Triton one on CUDA, torch otherwise;
    see `core.backends`); with them, filtered logits are formed first and scored at
    temperature 1 (greedy rows stay greedy).
    """
    if node_logits.shape[0] != tree.num_nodes:
        raise ValueError(f"node_logits has {node_logits.shape[0]} rows, tree has {tree.num_nodes}")
    temp = _expand_to_nodes(temperature, tree, torch.float32, "temperature")
    assert temp is not None
    logits = node_logits
    if top_k is not None or top_p is not None:
        node_top_k = _expand_to_nodes(top_k, tree, torch.long, "top_k")
        node_top_p = _expand_to_nodes(top_p, tree, torch.float32, "top_p")
        logits = filter_logits(node_logits, temp, node_top_k, node_top_p)
        temp = torch.where(temp == 0, 0.0, 1.0)
    streak = implementation(STREAK_KERNEL, logits.device, draft_logprob_streak_torch)
    log_a, tau, selected = streak(logits, temp, tree.tokens, tree.parents, tree.draft_nodes)
    return DraftScores(log_a, tau, selected)
