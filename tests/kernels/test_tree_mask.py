"""The packed ancestor bitmask agrees with the core's tree and survives the sign bit."""

import pytest
import torch

from vllm_specdiff.core.tree import build_token_tree
from vllm_specdiff_kernels.tree_mask import (
    num_mask_words,
    pack_bool_mask,
    tree_mask_from_parents,
    unpack_tree_mask,
)


def test_mask_matches_core_ancestor_mask():
    torch.manual_seed(1)
    drafts = torch.randint(0, 3, (3, 4, 5))
    tree = build_token_tree(torch.zeros(3, dtype=torch.long), drafts)
    packed = tree_mask_from_parents(tree.parents, tree.offsets)
    dense = tree.ancestor_mask()
    counts = tree.node_counts().tolist()
    assert packed.shape == (tree.num_nodes, num_mask_words(max(counts)))
    for b, start in enumerate(tree.offsets[:-1].tolist()):
        n = counts[b]
        unpacked = unpack_tree_mask(packed[start:start + n], dense.shape[-1])
        assert torch.equal(unpacked, dense[b, :n])


def test_pack_roundtrip_over_several_words():
    torch.manual_seed(2)
    bits = torch.rand(7, 70) < 0.5
    bits[:, 31] = True  # sign bit of word 0
    packed = pack_bool_mask(bits)
    assert packed.dtype == torch.int32 and packed.shape == (7, 3)
    assert (packed[:, 0] < 0).all()
    assert torch.equal(unpack_tree_mask(packed, 70), bits)


def test_chain_of_forty_nodes_sets_every_earlier_bit():
    parents = torch.arange(-1, 39)
    mask = unpack_tree_mask(tree_mask_from_parents(parents, torch.tensor([0, 40])), 40)
    assert torch.equal(mask, torch.ones(40, 40, dtype=torch.bool).tril())


def test_bad_offsets_are_rejected():
    with pytest.raises(ValueError, match="cu_seqlens covers"):
        tree_mask_from_parents(torch.tensor([-1, 0, 1]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="same request"):  # node 3's parent is in request 0
        tree_mask_from_parents(torch.tensor([-1, 0, -1, 1]), torch.tensor([0, 2, 4]))
