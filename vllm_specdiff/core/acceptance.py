"""Lossless acceptance rules. Each returns the accepted draft tokens plus one emitted token.

- point mass (the paper's rule): the selected draft is verified as if it had probability 1 under
  the drafter, so its own probabilities are never needed;
- tree (multi-candidate): walk the trie trying children in order against the renormalised
  remainder of `p`;
- standard (Leviathan et al.): `min(1, p/q)` with residual `norm(max(0, p - q))`, for K = 1 with
  the draft sampled from `q`.
Greedy requests need no special casing: their `p` is one-hot, so every rule reduces to "accept
while the draft equals the argmax, then emit the argmax". `verify_greedy` is the cheap path when a
whole batch is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specdiff.core.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    """tokens [B, G+1]: accepted draft tokens then the emitted token, -1 padded.

    num_accepted [B]: draft tokens accepted (0..G); the request emits num_accepted + 1 tokens.
    accepted_nodes [B, G]: for tree rules, the global node index of each accepted token (-1 pad).
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor | None = None

    def token_lists(self) -> list[list[int]]:
        """The emitted tokens of each request, without padding."""
        return [row[: n + 1] for row, n in zip(self.tokens.tolist(), self.num_accepted.tolist(),
                                               strict=True)]


def _leading_accepts(accept: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def _sample_rows(weights: torch.Tensor, fallback: torch.Tensor,
                 generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from unnormalised non-negative weights. A row with no mass left (only
    reachable through float rounding: x rejected although p(x) ~ 1) emits the argmax of its
    `fallback` row, the unmasked p, which is what exact arithmetic would have emitted."""
    weights = weights.clamp_min(0)
    empty = weights.sum(dim=-1) <= 0
    safe = torch.where(empty.unsqueeze(1), torch.ones_like(weights), weights)
    drawn = torch.multinomial(safe, 1, generator=generator).squeeze(1)
    return torch.where(empty, fallback.argmax(dim=-1), drawn)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, emitted: torch.Tensor,
              accepted_nodes: torch.Tensor | None = None) -> Verdict:
    b, g = draft_tokens.shape
    positions = torch.arange(g, device=draft_tokens.device).unsqueeze(0)
    tokens = torch.full((b, g + 1), -1, dtype=torch.long, device=draft_tokens.device)
    tokens[:, :g] = torch.where(positions < num_accepted.unsqueeze(1), draft_tokens, -1)
    tokens[torch.arange(b, device=tokens.device), num_accepted] = emitted
    return Verdict(tokens, num_accepted, accepted_nodes)


def _check_shapes(target: torch.Tensor, draft_tokens: torch.Tensor) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, G], got {tuple(draft_tokens.shape)}")
    b, g = draft_tokens.shape
    if target.shape[:2] != (b, g + 1):
        raise ValueError(f"target must start with [B, G+1] = [{b}, {g + 1}], "
                         f"got {tuple(target.shape)}")


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """Temperature 0: accept while the draft equals the verifier's argmax, then emit the argmax."""
    _check_shapes(target_argmax, draft_tokens)
    g = draft_tokens.shape[1]
    num_accepted = _leading_accepts(draft_tokens == target_argmax[:, :g])
    emitted = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _assemble(draft_tokens, num_accepted, emitted)


def verify_point_mass(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                      generator: torch.Generator | None = None) -> Verdict:
    """The paper's rule: accept x_j with probability p(x_j); on rejection emit from p without x_j.

    target_probs[:, j] is p at draft position j (j < G); target_probs[:, G] is the bonus
    distribution after a fully accepted draft.
    """
    _check_shapes(target_probs, draft_tokens)
    b, g = draft_tokens.shape
    rows = torch.arange(b, device=draft_tokens.device)
    probs = target_probs.float()
    a = probs[:, :g].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    coins = torch.rand(b, g, generator=generator, device=probs.device)
    num_accepted = _leading_accepts(coins < a)
    weights = probs[rows, num_accepted].clone()
    rejected = num_accepted < g
    rejected_token = draft_tokens[rows, num_accepted.clamp(max=g - 1)]
    weights[rows[rejected], rejected_token[rejected]] = 0.0
    emitted = _sample_rows(weights, probs[rows, num_accepted], generator)
    return _assemble(draft_tokens, num_accepted, emitted)


def verify_standard(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                    draft_probs: torch.Tensor, generator: torch.Generator | None = None
                    ) -> Verdict:
    """Leviathan et al.: accept with min(1, p/q); on rejection emit from norm(max(0, p - q)).

    Only valid for a single draft sampled from q (draft_probs [B, G, V]); with self-selection
    over K drafts it is biased, which the tests use as a negative control.
    """
    _check_shapes(target_probs, draft_tokens)
    b, g = draft_tokens.shape
    if draft_probs.shape[:2] != (b, g):
        raise ValueError(f"draft_probs must be [B, G, V], got {tuple(draft_probs.shape)}")
    rows = torch.arange(b, device=draft_tokens.device)
    probs = target_probs.float()
    q = draft_probs.float()
    index = draft_tokens.unsqueeze(2)
    p_x = probs[:, :g].gather(2, index).squeeze(2)
    q_x = q.gather(2, index).squeeze(2)
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.ones_like(p_x))
    coins = torch.rand(b, g, generator=generator, device=probs.device)
    num_accepted = _leading_accepts(coins < ratio.clamp(max=1.0))
    rejected = num_accepted < g
    at = num_accepted.clamp(max=g - 1)
    residual = (probs[rows, at] - q[rows, at]).clamp_min(0)
    weights = torch.where(rejected.unsqueeze(1), residual, probs[rows, num_accepted])
    # p == q at that position leaves no residual mass; rejection was then impossible in exact
    # arithmetic, so p itself is the right fallback.
    no_mass = rejected & (weights.sum(dim=-1) <= 0)
    weights[no_mass] = probs[rows, at][no_mass]
    emitted = _sample_rows(weights, probs[rows, num_accepted], generator)
    return _assemble(draft_tokens, num_accepted, emitted)


def path_probs(node_probs: torch.Tensor, tree: TokenTree, selected: torch.Tensor) -> torch.Tensor:
    """[B, G+1, V]: p at the root and at each token of the selected draft (for point-mass rules)."""
    b = tree.num_requests
    chosen = tree.draft_nodes[torch.arange(b, device=selected.device), selected]  # [B, G]
    index = torch.cat([tree.root_nodes().unsqueeze(1), chosen], dim=1)
    return node_probs[index]


def verify_tree(node_probs: torch.Tensor, tree: TokenTree,
                generator: torch.Generator | None = None) -> Verdict:
    """Multi-candidate tree verification, lossless for any trie (point-mass children).

    At each node the children c1..cm are tried in order; ci is accepted with probability
    p'(ci), p' being p with the already-rejected children removed and renormalised. If all are
    rejected, the emitted token is drawn from the last p'. Uniforms are drawn up front so the
    walk consumes the generator identically whatever the outcome.
    """
    b, g = tree.num_requests, tree.gamma
    device = node_probs.device
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    coins = torch.rand(b, g + 1, tree.num_drafts, generator=generator, device=device).cpu()
    emit_u = torch.rand(b, generator=generator, device=device).cpu()
    probs = node_probs.float().cpu()
    out_tokens = torch.full((b, g + 1), -1, dtype=torch.long)
    out_nodes = torch.full((b, g), -1, dtype=torch.long)
    num_accepted = torch.zeros(b, dtype=torch.long)
    for r, root in enumerate(tree.root_nodes().tolist()):
        node, depth = root, 0
        while True:
            remaining = probs[node].clone()
            accepted_child = -1
            for rank, child in enumerate(children[node]):
                mass = float(remaining.sum())
                tok = tokens[child]
                if mass > 0 and float(coins[r, depth, rank]) < float(remaining[tok]) / mass:
                    accepted_child = child
                    break
                remaining[tok] = 0.0
            if accepted_child < 0:
                if float(remaining.sum()) <= 0:
                    remaining = probs[node].clone()
                cdf = remaining.cumsum(0)
                choice = int(torch.searchsorted(cdf, emit_u[r] * cdf[-1], right=True))
                out_tokens[r, depth] = min(choice, remaining.shape[0] - 1)
                break
            out_tokens[r, depth] = tokens[accepted_child]
            out_nodes[r, depth] = accepted_child
            node, depth = accepted_child, depth + 1
        num_accepted[r] = depth
    return Verdict(out_tokens.to(device), num_accepted.to(device), out_nodes.to(device))
