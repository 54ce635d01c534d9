"""One request's candidate trie as vLLM sees it: a flat list of draft tokens plus its structure.

vLLM schedules, allocates KV slots for and returns logits at `1 + len(draft)` tokens per request
(the root, i.e. the last committed token, then the drafts). Sending a trie's nodes as that list
gives every node a KV slot and a logits row; the structure kept here says where each node sits.
Nodes are ordered with candidate 0's chain first (then the other nodes by depth), so any prefix of
the list that vLLM's scheduler keeps (token budget, max_model_len) is still a trie, and a prefix
of at most gamma nodes is a plain chain that vLLM verifies natively.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specdiff.core.tree import TokenTree, build_token_tree


@dataclass(frozen=True)
class RequestTrie:
    """tokens/parents/depths [N] local (node 0 = root, parent -1); draft_nodes [K, G] local;
    sources [K]: where each candidate came from ("argmax", "sample", "ngram")."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    draft_nodes: torch.Tensor
    sources: tuple[str, ...] = ()

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_drafts(self) -> int:
        return int(self.draft_nodes.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.draft_nodes.shape[1])

    def draft_tokens(self) -> list[int]:
        """What the proposer hands vLLM: every node but the root, in node order."""
        return self.tokens[1:].tolist()

    def is_chain(self, num_nodes: int | None = None) -> bool:
        """True when the first num_nodes nodes form root -> 1 -> 2 -> ... (vLLM's own case)."""
        n = self.num_nodes if num_nodes is None else num_nodes
        return bool((self.parents[1:n] == torch.arange(n - 1)).all())

    def truncated(self, num_nodes: int) -> RequestTrie:
        """The first num_nodes nodes, keeping the drafts that are entirely inside them.

        Candidate 0 comes first, so it survives whenever num_nodes > gamma.
        """
        if num_nodes >= self.num_nodes:
            return self
        complete = (self.draft_nodes < num_nodes).all(dim=1)
        if not bool(complete.any()):
            raise ValueError(f"no complete draft within {num_nodes} nodes")
        kept = tuple(src for src, keep in zip(self.sources, complete.tolist(), strict=True)
                     if keep)
        return RequestTrie(self.tokens[:num_nodes], self.parents[:num_nodes],
                           self.depths[:num_nodes], self.draft_nodes[complete], kept)

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node a may attend to node b iff b is a or an ancestor of a."""
        return self.token_tree().ancestor_mask()[0]

    def token_tree(self) -> TokenTree:
        """The core's batched representation (one request) for scoring."""
        n = self.num_nodes
        drafts = self.tokens[self.draft_nodes].unsqueeze(0)
        return TokenTree(self.tokens, self.parents, self.depths, torch.tensor([0, n]),
                         self.draft_nodes.unsqueeze(0), drafts)


def _chain_first(tree: TokenTree, sources: tuple[str, ...]) -> RequestTrie:
    """Re-order a one-request trie so that draft 0's nodes are 1..G (parents stay before
    children: the remaining nodes keep the trie's depth-major order)."""
    n = tree.num_nodes
    first = tree.draft_nodes[0, 0]
    rest = torch.ones(n, dtype=torch.bool)
    rest[0] = False
    rest[first] = False
    order = torch.cat([torch.zeros(1, dtype=torch.long), first, torch.nonzero(rest).squeeze(1)])
    new_index = torch.empty(n, dtype=torch.long)
    new_index[order] = torch.arange(n)
    parents = tree.parents[order]
    parents = torch.where(parents >= 0, new_index[parents.clamp_min(0)], parents)
    return RequestTrie(tree.tokens[order], parents, tree.depths[order],
                       new_index[tree.draft_nodes[0]], sources)


def build_request_trie(root_token: int, drafts: torch.Tensor, max_nodes: int,
                       sources: tuple[str, ...] | None = None) -> RequestTrie:
    """Merge drafts [K, G] (candidate 0 first) into a chain-first trie of at most max_nodes nodes
    (root included), dropping trailing candidates until it fits; candidate 0 always stays."""
    k, g = drafts.shape
    sources = sources or ("argmax",) + ("sample",) * (k - 1)
    if len(sources) != k:
        raise ValueError(f"{len(sources)} sources for {k} drafts")
    if max_nodes < g + 1:
        raise ValueError(f"max_nodes={max_nodes} cannot hold one draft of {g} tokens plus the root")
    root = torch.tensor([root_token], dtype=torch.long)
    drafts = drafts.long().cpu()
    for keep in range(k, 0, -1):
        tree = build_token_tree(root, drafts[:keep].unsqueeze(0))
        if tree.num_nodes <= max_nodes:
            return _chain_first(tree, sources[:keep])
    raise AssertionError("unreachable: one draft always fits")
