"""An optional low-rank Markov head on the conditioned drafter: drafts that agree with themselves.

The conditioned drafter drafts a block of gamma tokens from one forward, and slot k's logits,
`lm_head(h_k)`, do not depend on the token drafted at slot k-1: the marginals can mix hypotheses
(slot 1 favours one continuation, slot 2 another), so a drafted token whose predecessor was right
is still often wrong. The head (DSpark-style, small) makes every slot read its previous token:

    h'_k = h_k + W_out( silu(W_a h_k) * (W_b emb(p_k)) ),    logits_k = lm_head(h'_k)

with h_k the final-normed hidden state of slot k, p_1 the anchor and p_k the token at slot k-1,
always a *verifier* id embedded by the drafter's shared, frozen verifier embedding (a reduced head
drafts indices into `draft_to_verifier`, which are mapped back first). W_a, W_b: H -> r,
W_out: r -> H, no biases (`markov.w_a`, `markov.w_b`, `markov.w_out`; `markov_rank` r in
config.json, 0 = no head). W_out starts at zero, so a head added to a trained drafter changes no
draft until training moves it.

Training is teacher forced and parallel: p_k is the verifier's token (input_ids), known for every
slot (`previous_tokens`). Under greedy verification this is also exactly what acceptance needs:
slot k only counts when slots 1..k-1 matched the verifier's tokens.

Serving has no such tokens: `greedy_chain_logits` conditions each slot on the drafter's own
greedy path (slot 1 on the anchor, its argmax feeds slot 2, and so on: G small sequential
matmuls) and returns those per-slot logits; everything downstream (the argmax chain, K sampled
drafts, best-first trees, rejection sampling) reads them as before. For the greedy chain they are
the drafter's own chain. For a sampled draft or a tree branch that leaves the greedy path, the
slots after the non-greedy token are still conditioned on the greedy path: an approximation of
the drafter's own chain that can cost acceptance, never correctness, because verification assumes
nothing about where drafts came from and a sampled draft's q is the distribution it was sampled
from.

vLLM's `dflash` method has no such head: a drafter with one is served by the plugin in its native
format, and `specdiff-distill export --format dflash` refuses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # W_a, W_b: the scale of the drafter's other new projections


class MarkovHead(nn.Module):
    """h + W_out(silu(W_a h) * W_b e): a rank-r correction of slot states by the previous
    token's embedding e."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"a Markov head's rank must be >= 1, got {rank}")
        self.w_a = nn.Linear(hidden_size, rank, bias=False)
        self.w_b = nn.Linear(hidden_size, rank, bias=False)
        self.w_out = nn.Linear(rank, hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random W_a, W_b and a zero W_out: the head starts as the identity (same drafts)."""
        nn.init.normal_(self.w_a.weight, std=INIT_STD)
        nn.init.normal_(self.w_b.weight, std=INIT_STD)
        nn.init.zeros_(self.w_out.weight)

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """hidden[..., H] corrected by previous[..., H], the embeddings of the previous tokens."""
        return hidden + self.w_out(F.silu(self.w_a(hidden)) * self.w_b(previous))


def previous_tokens(input_ids: torch.Tensor, anchor_pos: torch.Tensor,
                    gamma: int) -> torch.Tensor:
    """p_k [B,M,G] of windows anchored at anchor_pos[B,M] (teacher forced): the tokens of
    input_ids[B,L] at anchor_pos + k - 1 for slots k = 1..G (the anchor itself for k = 1)."""
    b, m = anchor_pos.shape
    last = int(anchor_pos.max()) + gamma - 1
    if last >= input_ids.shape[1]:
        raise ValueError(f"a drafter with a Markov head reads the previous token of every slot: "
                         f"input_ids must reach position {last} (they end at "
                         f"{input_ids.shape[1] - 1})")
    index = anchor_pos[:, :, None] + torch.arange(gamma, device=anchor_pos.device)
    return input_ids.gather(1, index.reshape(b, m * gamma)).reshape(b, m, gamma)


def teacher_forced_logits(drafter: nn.Module, hidden: torch.Tensor,
                          previous: torch.Tensor | None) -> torch.Tensor:
    """Draft-head logits of slot states hidden[..., G, H] whose previous tokens are
    previous[..., G] (verifier ids; None or no head: the plain head, bit for bit)."""
    head = drafter.markov
    if head is None or previous is None:
        return drafter.lm_head(hidden)
    return drafter.lm_head(head(hidden, drafter.embed_tokens(previous).to(hidden.dtype)))


def greedy_chain_logits(drafter: nn.Module, hidden: torch.Tensor,
                        anchors: torch.Tensor) -> torch.Tensor:
    """Draft-head logits [B,G,V_draft] of slot states hidden[B,G,H] (serving): slot 1 conditioned
    on anchors[B] (verifier ids), each later slot on the previous slot's argmax, mapped to a
    verifier id through the reduced head's table when there is one."""
    head = drafter.markov
    if head is None:
        return drafter.lm_head(hidden)
    d2t = drafter.draft_to_verifier
    previous = anchors.to(hidden.device).long()
    slots = []
    for k in range(hidden.shape[1]):
        logits = drafter.lm_head(head(hidden[:, k], drafter.embed_tokens(previous)
                                      .to(hidden.dtype)))
        slots.append(logits)
        drafted = logits.argmax(-1)
        previous = drafted if d2t is None else d2t[drafted]
    return torch.stack(slots, dim=1)
