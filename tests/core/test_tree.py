import torch

from vllm_specdiff.core.tree import build_token_tree


def test_trie_merges_shared_prefixes_and_duplicates():
    drafts = torch.tensor([[[5, 6, 7], [5, 6, 8], [5, 6, 7], [9, 1, 2]]])
    tree = build_token_tree(torch.tensor([3]), drafts)
    assert tree.tokens.tolist() == [3, 5, 9, 6, 1, 7, 8, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 3, 4]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3, 3, 3]
    assert tree.offsets.tolist() == [0, 8]
    assert tree.draft_nodes.tolist() == [[[1, 3, 5], [1, 3, 6], [1, 3, 5], [2, 4, 7]]]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask()[0], expected)


def test_same_token_after_different_prefixes_is_two_nodes():
    drafts = torch.tensor([[[1, 2], [3, 2]]])
    tree = build_token_tree(torch.tensor([0]), drafts)
    assert tree.num_nodes == 5
    assert tree.draft_nodes[0, 0, 1] != tree.draft_nodes[0, 1, 1]


def test_k1_is_a_chain():
    drafts = torch.tensor([[[4, 4, 2]], [[1, 0, 3]]])
    tree = build_token_tree(torch.tensor([7, 8]), drafts)
    assert tree.tokens.tolist() == [7, 4, 4, 2, 8, 1, 0, 3]
    assert tree.parents.tolist() == [-1, 0, 1, 2, -1, 4, 5, 6]
    assert tree.depths.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert tree.draft_nodes.tolist() == [[[1, 2, 3]], [[5, 6, 7]]]
    mask = tree.ancestor_mask()
    assert torch.equal(mask[1], torch.ones(4, 4).tril().bool())


def test_identical_drafts_collapse_to_the_k1_chain():
    chain = torch.tensor([[[4, 4, 2]], [[1, 0, 3]]])
    roots = torch.tensor([7, 8])
    single = build_token_tree(roots, chain)
    repeated = build_token_tree(roots, chain.repeat(1, 3, 1))
    assert torch.equal(single.tokens, repeated.tokens)
    assert torch.equal(single.parents, repeated.parents)
    assert torch.equal(single.offsets, repeated.offsets)
    assert torch.equal(repeated.draft_nodes, single.draft_nodes.repeat(1, 3, 1))


def test_ragged_batch_round_trips_every_draft():
    gen = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 3, (4, 5, 4), generator=gen)
    drafts[1] = drafts[1, :1]  # request 1: all drafts identical -> a chain
    tree = build_token_tree(torch.tensor([9, 9, 9, 9]), drafts)
    counts = tree.node_counts().tolist()
    assert counts[1] == 5
    assert len(set(counts)) > 1  # ragged
    assert torch.equal(tree.tokens[tree.draft_nodes], drafts)
    for b in range(4):
        lo, hi = tree.offsets[b].item(), tree.offsets[b + 1].item()
        assert tree.parents[lo] == -1
        inner = tree.parents[lo + 1:hi]
        assert bool(((inner >= lo) & (inner < hi)).all())
        for k in range(5):
            nodes = tree.draft_nodes[b, k]
            assert tree.parents[nodes[0]] == lo
            assert torch.equal(tree.parents[nodes[1:]], nodes[:-1])
            assert tree.depths[nodes].tolist() == [1, 2, 3, 4]
        # distinct nodes have distinct (parent, token) pairs: the trie is minimal
        pairs = {(int(p), int(t)) for p, t in zip(tree.parents[lo + 1:hi], tree.tokens[lo + 1:hi],
                                                   strict=True)}
        assert len(pairs) == hi - lo - 1
    mask = tree.ancestor_mask()
    assert mask.shape == (4, max(counts), max(counts))
    assert not bool(mask[1, 5:].any()) and not bool(mask[1, :, 5:].any())


def test_ancestor_mask_matches_parent_walk():
    gen = torch.Generator().manual_seed(1)
    drafts = torch.randint(0, 2, (2, 6, 5), generator=gen)
    tree = build_token_tree(torch.tensor([0, 1]), drafts)
    mask = tree.ancestor_mask()
    for b in range(2):
        lo, hi = tree.offsets[b].item(), tree.offsets[b + 1].item()
        for a in range(lo, hi):
            ancestors = set()
            node = a
            while node >= 0:
                ancestors.add(node - lo)
                node = tree.parents[node].item()
            row = {i for i in range(hi - lo) if mask[b, a - lo, i]}
            assert row == ancestors
