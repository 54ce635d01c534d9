"""One request's candidate trie as vLLM sees it: a flat list of draft tokens plus its structure.

vLLM schedules, allocates KV slots for and returns logits at `1 + len(draft)` tokens per request
(the root, i.e. the last committed token, then the drafts). Sending a trie's nodes as that list
gives every node a KV slot and a logits row; the structure kept here says where each node sits.
Nodes are ordered with candidate 0's chain first (then the other nodes by depth), so any prefix of
the list that vLLM's scheduler keeps (token budget, max_model_len) is still a trie, and a prefix
of at most candidate 0's length is a plain chain that vLLM verifies natively.

Two kinds of trie reach the runner: K sampled drafts of one length merged (`build_request_trie`)
and a best-first tree (`best_first_trie`), whose candidates are its root-to-leaf paths, of
different lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specdiff.core.best_first import DraftTree, best_first_tree
from vllm_specdiff.core.tree import TokenTree, build_token_tree


@dataclass(frozen=True)
class RequestTrie:
    """tokens/parents/depths [N] local (node 0 = root, parent -1); draft_nodes [K, G] local;
    sources [K]: where each candidate came from ("argmax", "sample", "ngram", "best_first");
    lengths [K]: each candidate's own length where they differ (a best-first tree's leaves), its
    row of draft_nodes padded with its last node; None: every candidate has G tokens."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    draft_nodes: torch.Tensor
    sources: tuple[str, ...] = ()
    lengths: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_drafts(self) -> int:
        return int(self.draft_nodes.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.draft_nodes.shape[1])

    def candidate_length(self, k: int) -> int:
        return self.gamma if self.lengths is None else int(self.lengths[k])

    def path(self, k: int) -> torch.Tensor:
        """Candidate k's nodes, root excluded, without padding."""
        return self.draft_nodes[k, :self.candidate_length(k)]

    def draft_tokens(self) -> list[int]:
        """What the proposer hands vLLM: every node but the root, in node order."""
        return self.tokens[1:].tolist()

    def is_chain(self, num_nodes: int | None = None) -> bool:
        """True when the first num_nodes nodes form root -> 1 -> 2 -> ... (vLLM's own case)."""
        n = self.num_nodes if num_nodes is None else num_nodes
        return bool((self.parents[1:n] == torch.arange(n - 1)).all())

    def truncated(self, num_nodes: int) -> RequestTrie:
        """The first num_nodes nodes, keeping the drafts that are entirely inside them.

        Candidate 0 comes first, so it survives whenever num_nodes exceeds its length.
        """
        if num_nodes >= self.num_nodes:
            return self
        complete = (self.draft_nodes < num_nodes).all(dim=1)
        if not bool(complete.any()):
            raise ValueError(f"no complete draft within {num_nodes} nodes")
        kept = tuple(src for src, keep in zip(self.sources, complete.tolist(), strict=True)
                     if keep)
        return RequestTrie(self.tokens[:num_nodes], self.parents[:num_nodes],
                           self.depths[:num_nodes], self.draft_nodes[complete], kept,
                           None if self.lengths is None else self.lengths[complete])

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


def best_first_trie(root_token: int, tree: DraftTree) -> RequestTrie:
    """A best-first tree (`core.best_first`) as a chain-first trie whose candidates are its
    root-to-leaf paths: candidate 0 follows each node's best child (the drafter's argmax chain
    as far as the tree grew it), the others are the remaining leaves in best-first order."""
    n = tree.num_nodes
    parents = [int(p) + 1 for p in tree.parents.tolist()]  # local, the root being node 0
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for node, parent in enumerate(parents, start=1):
        children[parent].append(node)  # best-first order: a node's best child comes first
    chain, node = [], 0
    while children[node]:
        node = children[node][0]
        chain.append(node)
    in_chain = set(chain)
    order = [0, *chain, *(i for i in range(1, n + 1) if i not in in_chain)]
    new_index = {old: new for new, old in enumerate(order)}
    old_parents = [-1, *parents]
    leaves = [new_index[i] for i in order if not children[i]]
    new_parents = [-1 if i == 0 else new_index[old_parents[i]] for i in order]
    paths = []
    for leaf in leaves:
        path, node = [], leaf
        while node > 0:
            path.append(node)
            node = new_parents[node]
        paths.append(path[::-1])
    depth = max(len(p) for p in paths)
    draft_nodes = torch.tensor([p + [p[-1]] * (depth - len(p)) for p in paths])
    tokens = torch.tensor([root_token, *tree.tokens.tolist()])[torch.tensor(order)]
    depths = torch.tensor([0, *tree.depths.tolist()])[torch.tensor(order)]
    return RequestTrie(tokens, torch.tensor(new_parents), depths, draft_nodes,
                       ("argmax",) + ("best_first",) * (len(paths) - 1),
                       torch.tensor([len(p) for p in paths]))


def best_first_drafts(logits: torch.Tensor, roots: list[int], as_tree: list[bool], budget: int
                      ) -> list[tuple[list[int], RequestTrie | None]]:
    """Per row of drafter logits [R, G, V]: with `as_tree[r]`, the best-first tree of `budget`
    nodes grown from the row's marginals (temperature 1) as a trie on `roots[r]`, and its
    nodes as the draft; otherwise the argmax chain and no trie (as the chain drafts: no
    normalisation over the vocabulary for a row that needs none)."""
    out: list[tuple[list[int], RequestTrie | None]] = []
    for row, root, tree in zip(logits, roots, as_tree, strict=True):
        if not tree:
            out.append((row.argmax(dim=-1).tolist(), None))
            continue
        trie = best_first_trie(root, best_first_tree(row.float().log_softmax(dim=-1), budget))
        out.append((trie.draft_tokens(), trie))
    return out
