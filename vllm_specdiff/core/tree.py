"""Merging K drafts into a token trie that the verifier scores in one forward pass.

Drafts that share a prefix share the verifier's work on it; duplicate drafts collapse entirely.
Each request's block starts with a ROOT node (the last committed token, not yet in the KV cache),
so the verifier's output at the root is the distribution of every draft's first token, and its
output at any other node is the distribution of the token that follows that node's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    """A batch of flattened token tries, request-major, each request's node 0 being its root.

    tokens:      [N] token id of every node.
    parents:     [N] global index of each node's parent; -1 for roots.
    depths:      [N] 0 for roots, j for a draft's j-th token (1-based); a node's position is
                 len(s) - 1 + depth, the root sitting at position len(s) - 1.
    offsets:     [B + 1] node range of each request.
    draft_nodes: [B, K, G] global node index of draft k's j-th token.
    drafts:      [B, K, G] the drafts themselves.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    offsets: torch.Tensor
    draft_nodes: torch.Tensor
    drafts: torch.Tensor

    @property
    def num_requests(self) -> int:
        return self.draft_nodes.shape[0]

    @property
    def num_drafts(self) -> int:
        return self.draft_nodes.shape[1]

    @property
    def gamma(self) -> int:
        return self.draft_nodes.shape[2]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    def node_counts(self) -> torch.Tensor:
        """[B] number of nodes (root included) of each request."""
        return self.offsets[1:] - self.offsets[:-1]

    def request_index(self) -> torch.Tensor:
        """[N] the request each node belongs to."""
        return torch.repeat_interleave(
            torch.arange(self.num_requests, device=self.tokens.device), self.node_counts())

    def position_offsets(self) -> torch.Tensor:
        """[N] position of each node relative to its request's root."""
        return self.depths

    def root_nodes(self) -> torch.Tensor:
        """[B] global index of each request's root."""
        return self.offsets[:-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[B, Nmax, Nmax] bool: node a may attend to node b iff b is a or an ancestor of a.

        Padding rows and columns (beyond a request's node count) are False.
        """
        counts = self.node_counts()
        b, n_max = self.num_requests, int(counts.max())
        req = self.request_index()
        local = torch.arange(self.num_nodes, device=self.tokens.device) - self.offsets[req]
        mask = torch.zeros(b, n_max, n_max, dtype=torch.bool, device=self.tokens.device)
        current = torch.arange(self.num_nodes, device=self.tokens.device)
        alive = torch.ones_like(current, dtype=torch.bool)
        for _ in range(self.gamma + 1):
            cur_local = current - self.offsets[req]
            mask[req[alive], local[alive], cur_local[alive]] = True
            parent = self.parents[current]
            alive = alive & (parent >= 0)
            current = torch.where(alive, parent, current)
        return mask


def _chain_tree(root_tokens: torch.Tensor, drafts: torch.Tensor) -> TokenTree:
    """K = 1: the tree is a chain root -> x_1 -> ... -> x_G; no prefix comparison needed."""
    b, _, g = drafts.shape
    device = drafts.device
    per = g + 1
    offsets = torch.arange(b + 1, device=device) * per
    local = torch.arange(per, device=device)
    tokens = torch.cat([root_tokens.unsqueeze(1), drafts[:, 0, :]], dim=1).reshape(-1)
    parents = (offsets[:-1].unsqueeze(1) + local - 1)
    parents[:, 0] = -1
    depths = local.repeat(b)
    draft_nodes = (offsets[:-1].unsqueeze(1) + local[1:]).unsqueeze(1)
    return TokenTree(tokens, parents.reshape(-1), depths, offsets, draft_nodes, drafts)


def build_token_tree(root_tokens: torch.Tensor, drafts: torch.Tensor) -> TokenTree:
    """Merge each request's K drafts [B, K, G] into a trie, nodes ordered by (depth, draft)."""
    if drafts.dim() != 3:
        raise ValueError(f"drafts must be [B, K, G], got shape {tuple(drafts.shape)}")
    b, k, g = drafts.shape
    if root_tokens.shape != (b,):
        raise ValueError(f"root_tokens must be [{b}], got shape {tuple(root_tokens.shape)}")
    if g < 1:
        raise ValueError("gamma must be >= 1")
    drafts = drafts.long()
    root_tokens = root_tokens.long().to(drafts.device)
    if k == 1:
        return _chain_tree(root_tokens, drafts)
    device = drafts.device
    # same_prefix[b, k, k', j]: drafts k and k' agree on tokens 1..j.
    equal = drafts.unsqueeze(2) == drafts.unsqueeze(1)
    same_prefix = equal.int().cumprod(dim=-1).bool()
    canonical = same_prefix.int().argmax(dim=2)  # [B, K, G] first draft with the same prefix
    is_new = canonical == torch.arange(k, device=device).view(1, k, 1)
    new_by_depth = is_new.permute(0, 2, 1).reshape(b, g * k)  # depth-major order
    local_index = new_by_depth.long().cumsum(dim=1)  # 1-based; root is local 0
    counts = 1 + new_by_depth.sum(dim=1)
    offsets = torch.zeros(b + 1, dtype=torch.long, device=device)
    offsets[1:] = counts.cumsum(0)
    local_by_depth = local_index.reshape(b, g, k)  # [B, G, K] valid where the node is new
    canon_t = canonical.permute(0, 2, 1)  # [B, G, K]
    draft_local = local_by_depth.gather(2, canon_t).permute(0, 2, 1)  # [B, K, G]
    draft_nodes = offsets[:-1].view(b, 1, 1) + draft_local
    n = int(offsets[-1])
    tokens = torch.empty(n, dtype=torch.long, device=device)
    parents = torch.empty(n, dtype=torch.long, device=device)
    depths = torch.empty(n, dtype=torch.long, device=device)
    roots = offsets[:-1]
    tokens[roots] = root_tokens
    parents[roots] = -1
    depths[roots] = 0
    parent_nodes = torch.cat([roots.view(b, 1, 1).expand(b, k, 1), draft_nodes[:, :, :-1]], dim=2)
    flat_nodes = draft_nodes.reshape(-1)
    tokens[flat_nodes] = drafts.reshape(-1)
    parents[flat_nodes] = parent_nodes.reshape(-1)
    depths[flat_nodes] = torch.arange(1, g + 1, device=device).expand(b, k, g).reshape(-1)
    return TokenTree(tokens, parents, depths, offsets, draft_nodes, drafts)
